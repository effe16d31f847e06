"""What Whisper's timestamps cost a transcription: /v1/audio/transcriptions answered in-process (the server's app on
an AsyncEngine, through ASGI) for the same clips as json (no timestamps), verbose_json (segments from timestamp
tokens) and verbose_json with word timestamps (a second, teacher-forced decoder pass per clip and dynamic time
warping), interleaved round by round. Whisper-tiny's shapes with random weights (bench/whisper_throughput.py's
model); the temperature fallback is off, so that each format decodes once.

    python bench/whisper_words.py --clips 8 --seconds 20 --rounds 3
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

FORMATS = {"json": {"response_format": "json"},
           "verbose_json (segments)": {"response_format": "verbose_json"},
           "verbose_json + words": {"response_format": "verbose_json",
                                    "timestamp_granularities[]": ["segment", "word"]}}


async def run(folder: Path, clips: int, seconds: float, rounds: int) -> dict[str, list[float]]:
    import httpx

    from streamer.engine.async_engine import AsyncEngine
    from streamer.server.app import build_app
    from streamer.server.audio_api import TranscriptionConfig
    from tests.test_server_audio import wav_bytes
    from tests.whisper_checkpoints import tone
    audio = [wav_bytes(tone(seconds, 150.0 + 37.0 * i, seed=i)) for i in range(clips)]
    times: dict[str, list[float]] = {name: [] for name in FORMATS}
    async with AsyncEngine(str(folder), dtype="float32", max_num_seqs=clips, kv_cache_memory=4 << 30) as engine:
        app = build_app(engine, transcription=TranscriptionConfig(fallback_temperatures=()))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench",
                                     timeout=600) as client:
            async def one(data: bytes, fields: dict) -> None:
                r = await client.post("/v1/audio/transcriptions", files={"file": ("a.wav", data)},
                                      data={"language": "en", **fields})
                r.raise_for_status()
            for r in range(rounds + 1):  # (round 0 warms up)
                for name, fields in FORMATS.items():
                    t = time.perf_counter()
                    await asyncio.gather(*(one(a, fields) for a in audio))
                    if r:
                        times[name].append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clips", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import whisper_throughput
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        whisper_throughput.make_model(folder, "tiny")
        times = asyncio.run(run(folder, args.clips, args.seconds, args.rounds))
    base = statistics.median(times["json"])
    print(f"whisper-tiny shapes, random weights, fp32; {args.clips} clips of {args.seconds:g} s at once, "
          f"{args.rounds} rounds (median)")
    print(f"{'format':<26}{'seconds':>9}{'vs json':>9}   runs")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<26}{med:>9.2f}{med / base:>8.2f}x   {', '.join(f'{t:.2f}' for t in ts)}")


if __name__ == "__main__":
    main()

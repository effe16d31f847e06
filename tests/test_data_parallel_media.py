"""Data parallelism with multimodal models and prompt embeddings (streamer/engine/data_parallel.py): the front holds
the replicas' prompts object (ImagePrompts, sent back pickled at start) for chat templates and /tokenize, and a prompt
with images (or embeddings) goes to a replica as it came, which loads and encodes them. DP=2 answers as DP=1 (fp32,
greedy), offline and through the server with the openai client."""
from __future__ import annotations

import pickle

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")  # the checkpoints

from streamer import LLM, SamplingParams  # noqa: E402
from tests.server_utils import LiveServer  # noqa: E402
from tests.test_multimodal import GEMMA_PROMPT, _data_url, gemma3_dir, images  # noqa: E402,F401

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
ENGINE = dict(dtype="float32", num_kv_blocks=64, enforce_eager=True)
TEXT_ONLY = "<start_of_turn>user\nno picture<end_of_turn>\n<start_of_turn>model\n"


def _prompts() -> list:
    return [{"prompt": GEMMA_PROMPT, "multi_modal_data": {"image": im}} for im in images(3, seed=4)] + [TEXT_ONLY]


def _chat(url: str, image_url: str) -> tuple[str, int]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                               {"type": "text", "text": "What is in the picture?"}]}])
    return r.choices[0].message.content, r.usage.prompt_tokens


def test_dp2_with_images_equals_dp1(gemma3_dir):  # noqa: F811
    """Offline and served: image prompts on two replicas give DP=1's tokens; the server's chat and /tokenize see the
    model's image placeholders through the replica's prompts object."""
    image_url = _data_url(images(1, seed=5)[0])
    with LLM(str(gemma3_dir), **ENGINE) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY)]
        want_prompt_ids = llm.generate(_prompts()[:1], GREEDY)[0].prompt_token_ids
    with LLM(str(gemma3_dir), data_parallel_size=2, **ENGINE) as llm:
        assert llm.engine.image_prompts is not None
        outs = llm.generate(_prompts(), GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert outs[0].prompt_token_ids == want_prompt_ids
        assert all(n > 0 for n in llm.engine.engine.router.routed)  # (both replicas worked)
    def tokenize(server: LiveServer) -> list[int]:
        body = {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": "hi"}]}]}
        r = httpx.post(server.url + "/tokenize", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    with LiveServer(gemma3_dir, **ENGINE) as one:
        want_chat, want_tokens = _chat(one.url, image_url), tokenize(one)
    with LiveServer(gemma3_dir, data_parallel_size=2, dp_routing="round_robin", **ENGINE) as two:
        got = [_chat(two.url, image_url) for _ in range(2)]  # (round robin: one on each replica)
        routed = list(two.engine.router.routed)
        got_tokens = tokenize(two)  # (the image's soft tokens placed by the front, as a replica will read them)
    assert routed == [1, 1]
    assert got == [want_chat, want_chat]
    assert want_chat[0]
    assert got_tokens == want_tokens


def test_prompt_objects_pickle_for_the_front(ckpt_root):
    """Every model's prompts object crosses from a replica to the front: Qwen3-VL's (a tokenizer-bound function
    for its frame times) included, and it works on the other side."""
    from tests.test_qwen3_vl_video import make_qwen3_vl_video_checkpoint
    path = ckpt_root / "qwen3_vl_video"
    if not (path / "config.json").exists():
        make_qwen3_vl_video_checkpoint(path)
    with LLM(str(path), **ENGINE) as llm:
        mm = llm.engine.image_prompts
        back = pickle.loads(pickle.dumps(mm))
        assert back.encode_text("<1.0 seconds>") == mm.encode_text("<1.0 seconds>") != []


def test_dp2_with_prompt_embeddings_equals_dp1(llama_dir):
    """Prompts given as embeddings (--enable-prompt-embeds) reach a replica as tensors: DP=2 gives DP=1's tokens,
    offline and through the server's prompt_embeds (base64 torch.save)."""
    import torch
    from safetensors.torch import load_file

    from tests.test_prompt_embeds import _b64
    weights: dict = {}
    for f in sorted(llama_dir.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    table = weights["model.embed_tokens.weight"].float()
    embeds = [table[torch.tensor(ids)] for ids in ([5, 17, 33, 9, 100], [40, 41, 42] * 5)]
    prompts = [{"prompt_embeds": e} for e in embeds]
    kw = dict(dtype="float32", enforce_eager=True, enable_prompt_embeds=True)
    with LLM(str(llama_dir), **kw) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    with LLM(str(llama_dir), data_parallel_size=2, **kw) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == want
    with LiveServer(llama_dir, data_parallel_size=2, dp_routing="round_robin", **kw) as two:
        client = openai.OpenAI(base_url=two.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        got = []
        for e in embeds:
            r = client.completions.create(model=client.models.list().data[0].id, prompt="", max_tokens=6,
                                          temperature=0.0, logprobs=1,
                                          extra_body={"prompt_embeds": _b64(e), "ignore_eos": True,
                                                      "return_tokens_as_token_ids": True})
            got.append([int(t.split(":", 1)[1]) for t in r.choices[0].logprobs.tokens])
        routed = list(two.engine.router.routed)
    assert got == want
    assert routed == [1, 1]

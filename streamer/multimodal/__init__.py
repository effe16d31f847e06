"""Inputs other than text: images, videos and audio (fetching, decoding, placing) and their processors; Whisper's decoding rules and word timestamps."""

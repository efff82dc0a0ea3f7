"""llama-server (bench/build_llamacpp.sh's) as the reference for a GGUF's next-token logprobs:
the one comparison the families' tests make against it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
import torch

from bench.server_proc import llama_server


def assert_same_next_token_logprobs(
    binary: Path,
    path: Path,
    log: Path,
    prompts: Sequence[list[int]],
    logits_of: Callable[[int, list[int]], torch.Tensor],
    tolerance: float,
    exact_argmax: bool = True,
    least: int = 5,
) -> float:
    """llama-server (one thread, `binary`) on the GGUF `path`: for each prompt its greedy next
    token and top-5 logprobs against log_softmax of `logits_of(i, prompt)` (cellserve's last
    row, float32 or float64): every one within `tolerance`, its top token cellserve's argmax
    (without `exact_argmax`: within `tolerance` of cellserve's best, as rounded weights may
    swap near-ties). A prompt whose next token is a partial UTF-8 character gets no
    probabilities (llama-server holds it back) and is not compared; at least `least` are.
    Returns the largest difference seen."""
    compared, worst = 0, 0.0
    with llama_server(binary, path, log, n_threads=1) as served:
        for i, ids in enumerate(prompts):
            body = {"prompt": ids, "n_predict": 1, "n_probs": 5, "cache_prompt": False}
            body |= {"temperature": 0, "ignore_eos": True}
            out = httpx.post(f"{served.url}/completion", json=body, timeout=60).json()
            if "completion_probabilities" not in out:
                continue
            top = out["completion_probabilities"][0]["top_logprobs"]
            logits = logits_of(i, ids)
            ours = torch.log_softmax(logits.double(), -1)
            if exact_argmax:
                assert top[0]["id"] == int(logits.argmax()), (i, top[0])
            assert float(ours.max() - ours[top[0]["id"]]) < tolerance, (i, top[0])
            for t in top:
                diff = abs(float(ours[t["id"]]) - t["logprob"])
                assert diff < tolerance, (i, t, float(ours[t["id"]]))
                worst = max(worst, diff)
            compared += 1
    assert compared >= least, f"{compared} of {len(prompts)} prompts compared"
    return worst


def llama_server_or_skip() -> Path:
    """bench/build_llamacpp.sh's llama-server; the calling test is skipped where it is not built."""
    import pytest

    from bench.server_proc import llamacpp_default

    binary = llamacpp_default()
    if not binary.is_file():
        pytest.skip(f"no llama-server at {binary} (bench/build_llamacpp.sh builds it)")
    return binary

"""The code-edit workload (bench/workloads.py) and bench/fidelity.py's comparison."""

from __future__ import annotations

import math
import random

import pytest

from bench.fidelity import compare
from bench.workloads import PromptBuilder, WorkloadSpec, build_sessions, code_edit_turn


def test_code_edit_turns_ask_to_rename_a_variable_of_the_function() -> None:
    prompt, old, new = code_edit_turn(random.Random(3), 200)
    code = prompt.split("```python\n")[1].split("\n```")[0]
    assert f"`{old}` to `{new}`" in prompt and new.startswith(old + "_")
    assert code.startswith("def compute_") and code.endswith(f"return {old}")
    assert 600 <= len(code) <= 1100  # ~4 characters a token
    compile(code, "<edit>", "exec")  # it is Python
    assert code_edit_turn(random.Random(3), 200) == (prompt, old, new)
    sessions = build_sessions(WorkloadSpec("code-edit", 3, 200), PromptBuilder(random.Random(0)))
    assert len({s.user_turns[0] for s in sessions}) == 3 and all(s.system == "" for s in sessions)


def test_fidelity_compare_counts_agreement_and_kl_until_the_texts_part() -> None:
    p = {1: math.log(0.7), 2: math.log(0.2), 3: math.log(0.1)}
    q = {1: math.log(0.5), 2: math.log(0.4), 3: math.log(0.1)}
    a = [[(1, p), (2, p), (3, p)]]
    assert compare(a, a) == {"positions": 3, "top1": 1.0, "kl": 0.0}
    b = [[(1, q), (5, q), (3, q)]]  # parts at the second position: the third is not compared
    got = compare(a, b)
    kl = 0.7 * math.log(0.7 / 0.5) + 0.2 * math.log(0.2 / 0.4)
    assert got["positions"] == 2 and got["top1"] == 0.5
    assert got["kl"] == pytest.approx(kl, abs=1e-5)

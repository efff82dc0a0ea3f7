"""The family files in model/arch/: each one is listed, and a name finds one family."""

from __future__ import annotations

import importlib
import pkgutil

import model.arch
from model.arch import FAMILIES, Family, family_of_gguf, family_of_hf

# the files of model/arch/ that describe no family (the encoders' too: they keep no cells)
_NOT_FAMILIES = {"args", "ssm_args", "family", "weights", "bert", "embedding_gemma"}


def test_every_family_file_is_listed() -> None:
    """A family written in its own file but left out of FAMILIES would be refused by name."""
    for info in pkgutil.iter_modules(model.arch.__path__):
        if info.name in _NOT_FAMILIES:
            continue
        module = importlib.import_module(f"model.arch.{info.name}")
        families = [v for v in vars(module).values() if isinstance(v, Family)]
        assert families, f"model/arch/{info.name}.py declares no Family"
        for family in families:
            assert family in FAMILIES, f"{family.arch} (model/arch/{info.name}.py) is not listed"


def test_each_name_finds_one_family() -> None:
    archs = [f.arch for f in FAMILIES]
    model_types = [t for f in FAMILIES for t in f.model_types]
    assert len(set(archs)) == len(archs)
    assert len(set(model_types)) == len(model_types)
    for family in FAMILIES:
        assert family_of_gguf(family.arch) is family
        assert all(family_of_hf(t) is family for t in family.model_types)
    assert family_of_gguf("bert") is None and family_of_hf("gemma3") is None


def test_recurrent_families_read_whole_and_have_no_hooks() -> None:
    """A recurrent family reads its ModelArgs whole (gguf_args / hf_args / hf_tensors), so a
    from_* hook on one would never run; a dense family reads through the shared loaders, so a
    whole reader on one would shadow them."""
    for family in FAMILIES:
        whole = (family.gguf_args, family.hf_args, family.hf_tensors)
        if family.recurrent:
            assert all(f is not None for f in whole), family.arch
            assert family.from_gguf is None and family.from_hf is None, family.arch
        else:
            assert all(f is None for f in whole), family.arch
            assert family.hf_convert is None and family.gguf_convert is None, family.arch

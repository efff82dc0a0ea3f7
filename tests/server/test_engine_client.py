"""The routes' view of the engine (server.engine_client.EngineClient) fits the real engine and
the fake one, so a route that works over the fake uses nothing the real engine lacks."""

from __future__ import annotations

import inspect

from scheduler.engine import Engine
from server.engine_client import EngineClient
from tests.server.fake_engine import FakeEngine

METHODS = ("start", "shutdown", "submit", "abort", "stats", "slots", "cell_map")


def test_real_and_fake_engines_are_engine_clients():
    assert isinstance(FakeEngine(), EngineClient)
    for name in METHODS:
        assert callable(getattr(Engine, name, None)), name


def test_the_fake_takes_the_same_parameters_as_the_real_engine():
    for name in METHODS:
        real = list(inspect.signature(getattr(Engine, name)).parameters)
        fake = list(inspect.signature(getattr(FakeEngine, name)).parameters)
        assert fake == real, (name, fake, real)


def test_the_fake_cell_map_matches_its_slots():
    engine = FakeEngine(n_cells=64)
    snap = engine.cell_map()
    assert snap.n_cells == 64 and snap.slots == [] and (snap.owner_map == -1).all()

"""The routing settings (tritonblas_ops/settings.py): one object, changed one way, every
public switch a user reaches from `tritonblas_ops`."""

import pytest

import tritonblas_ops
from tritonblas_ops import lowering, settings
from tritonblas_ops.settings import Path, Policy, RoutingSettings, parse_bool


@pytest.fixture(autouse=True)
def restored():
    before = settings.current()
    yield
    settings.restore(before)


def test_public_switches_change_the_one_settings_object():
    settings.restore(RoutingSettings())
    tritonblas_ops.disable()
    assert not tritonblas_ops.is_enabled() and not settings.current().enabled
    tritonblas_ops.enable()
    assert tritonblas_ops.get_policy() == "auto"  # the default
    tritonblas_ops.set_policy("shared")
    tritonblas_ops.route_cpu(True)
    assert settings.current() == RoutingSettings(policy=Policy.SHARED, cpu=True)
    assert tritonblas_ops.get_policy() == "shared"
    with pytest.raises(ValueError, match="policy must be one of 'auto', 'shared', 'all', got 'fastest'"):
        tritonblas_ops.set_policy("fastest")


def test_routing_scope_restores_only_what_it_changed():
    settings.restore(RoutingSettings())
    with tritonblas_ops.routing(False, path="inline"):
        assert settings.current() == RoutingSettings(enabled=False, path=Path.INLINE)
        tritonblas_ops.route_cpu(True)  # changed inside the block, by someone else
    assert settings.current() == RoutingSettings(cpu=True)


def test_the_names_the_docs_give_exist():
    """`tritonblas_ops.routing` is the context manager; the modules behind it are reachable
    by the names the README and the warnings give."""
    assert callable(tritonblas_ops.routing) and callable(tritonblas_ops.route_cpu)
    assert lowering.cache_key_pass() is lowering._KEY_PASS


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), (" On ", True), ("YES", True),
                                            ("0", False), ("False", False), ("off", False), ("no", False)])
def test_on_off_spellings(value, expected):
    assert parse_bool("X", value) is expected


def test_unknown_spellings_are_refused():
    with pytest.raises(ValueError, match=r"X must be one of 1, true, on, yes, 0, false, off, no, got 'maybe'"):
        parse_bool("X", "maybe")


@pytest.mark.parametrize("switch,query,field,variable,default", [
    (tritonblas_ops.batch_invariant, tritonblas_ops.is_batch_invariant, "batch_invariant",
     settings.BATCH_INVARIANT_ENV, False),
    (tritonblas_ops.fuse_epilogues, tritonblas_ops.is_fusing_epilogues, "fuse_epilogues",
     settings.FUSE_EPILOGUES_ENV, False),
    (tritonblas_ops.warp_specialize, tritonblas_ops.is_warp_specializing, "warp_specialize",
     settings.WARP_SPECIALIZE_ENV, True),
], ids=["batch_invariant", "fuse_epilogues", "warp_specialize"])
def test_on_off_switches_and_their_environment(switch, query, field, variable, default, monkeypatch):
    settings.restore(RoutingSettings())
    assert query() is default
    switch(True)
    assert query() and getattr(settings.current(), field)
    switch(False)
    assert not query()
    monkeypatch.delenv(variable, raising=False)
    assert getattr(settings.RoutingSettings.from_environment(), field) is default
    monkeypatch.setenv(variable, "on")
    assert getattr(settings.RoutingSettings.from_environment(), field)
    monkeypatch.setenv(variable, "off")
    assert not getattr(settings.RoutingSettings.from_environment(), field)
    monkeypatch.setenv(variable, "maybe")
    with pytest.raises(ValueError, match=f"{variable} must be one of"):
        settings.RoutingSettings.from_environment()

"""The registries the lower layers keep, and the toy world that fills them as a plugin.

The lower layers never import ``asyncrl.builtin`` (tests/test_layout.py checks); its tasks,
games, episode, reward and shipped models arrive through the registries, loaded on the first
lookup.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from asyncrl.episodes.resolve import ENVIRONMENTS, EPISODES, builtin_environment, resolve_episode
from asyncrl.errors import ConfigError
from asyncrl.models.loading import SHIPPED_MODELS, load_tokenizer
from asyncrl.plugins import Registry
from asyncrl.prompts.sources import GENERATED_TASKS
from asyncrl.rewards.registry import REWARDS, resolve_reward


def test_the_toy_world_registers_every_name_the_config_offers() -> None:
    assert GENERATED_TASKS.names() == ["arithmetic", "chain", "environment", "guess"]  # environment: core
    assert ENVIRONMENTS.names() == ["calculator", "guess"]
    assert EPISODES.names() == ["verify"]
    assert set(SHIPPED_MODELS.names()) == {
        "arith", "arith-teacher", "calculator", "chain", "guess", "moe", "tools", "verify",
    }  # fmt: skip
    assert "chain_match" in REWARDS and "exact_match" in REWARDS
    assert all((SHIPPED_MODELS.get(name) / "config.json").is_file() for name in SHIPPED_MODELS.names())


def test_a_registry_looks_names_up_and_refuses_a_second_entry_under_one_name() -> None:
    registry: Registry[int] = Registry("number")
    one = registry.register("one", 1)
    assert one == 1 and registry.get("one") == 1 and registry.get("two") is None
    registry.register("one", 1)  # the same entry again (a module imported twice) is no change
    with pytest.raises(ValueError, match="number 'one' is registered twice"):
        registry.register("one", 2)
    assert registry.names() == ["one"] and list(registry) == ["one"]


def test_a_light_registry_is_filled_before_an_entry_from_outside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Registered before anything was read, an outside entry still comes after the entries of
    the modules that fill the registry (a report's own panels precede a plugin's)."""
    holder = types.ModuleType("asyncrl_test_shelf")
    holder.SHELF = Registry("shelf entry", filled_by=("asyncrl_test_shelf_fill",))
    monkeypatch.setitem(sys.modules, "asyncrl_test_shelf", holder)
    (tmp_path / "asyncrl_test_shelf_fill.py").write_text(
        "import asyncrl_test_shelf\n"
        "asyncrl_test_shelf.SHELF.register('shipped', 1)\n"
        "asyncrl_test_shelf.SHELF.register('also_shipped', 2)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "asyncrl_test_shelf_fill", raising=False)
    holder.SHELF.register("outside", 3)
    assert holder.SHELF.entries() == [("shipped", 1), ("also_shipped", 2), ("outside", 3)]


def test_unknown_names_are_refused_with_what_is_registered() -> None:
    with pytest.raises(ConfigError, match=r"episode.environment.*'calculator', 'guess', 'verify'"):
        resolve_episode("chess", max_turns=4)
    with pytest.raises(ConfigError, match=r"allowed: \['calculator', 'guess'\]"):
        builtin_environment("verify", 4)
    with pytest.raises(ConfigError, match=r"model.path.*allowed: \['builtin:arith'"):
        load_tokenizer("builtin:nothing")
    with pytest.raises(ConfigError, match="chain_match"):
        resolve_reward("no_such_reward")


@pytest.mark.slow  # a fresh interpreter importing a low layer (7 s); lookups in this process: the tests above
def test_a_lookup_loads_the_plugin_that_no_lower_layer_imports() -> None:
    """In a fresh interpreter, a low layer alone: the toy world is not imported until a name is read."""
    script = textwrap.dedent(
        """
        import sys
        from asyncrl.rewards.registry import resolve_reward
        from asyncrl.models.loading import load_tokenizer
        before = "asyncrl.builtin.register" in sys.modules
        fn = resolve_reward("chain_match")
        tokenizer, positions = load_tokenizer("builtin:arith")
        print(before, fn("17, 22", "17,22"), positions > 0)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "1.0", "True"]

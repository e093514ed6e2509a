"""Plugin files: each way a user file can be wrong gives a PluginError that names the flag and the problem."""

import asyncio
import textwrap

import pytest

from areno.config import ConfigError
from areno.training.plugins import PluginError, load_agent, load_dataset_loader, load_function, load_reward_fn


def _file(tmp_path, source, name="plugin.py"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(source))
    return str(p)


def _error(fn, path) -> PluginError:
    with pytest.raises(PluginError) as e:
        fn(path)
    assert isinstance(e.value, ConfigError)  # a ValueError the CLI reports as a bad flag
    return e.value


def test_valid_plugins_load_and_run(tmp_path):
    (tmp_path / "helper_mod_areno_test.py").write_text("BONUS = 0.5\n")
    reward = load_reward_fn(_file(tmp_path, """
        import dataclasses
        from helper_mod_areno_test import BONUS  # the plugin's own folder is importable

        @dataclasses.dataclass
        class Box:  # dataclasses need the module registered in sys.modules
            x: int

        def reward_fn(record):
            return float(record["completion"] == "yes") + BONUS + Box(0).x
    """))
    assert reward({"completion": "yes"}) == 1.5
    loader = load_dataset_loader(_file(tmp_path, """
        def load_training_dataset(path, *, default_loader, **kwargs):
            return [{"prompt": path}]
    """, "loader.py"))
    assert loader("p", default_loader=None) == [{"prompt": "p"}]
    agent = load_agent(_file(tmp_path, """
        async def run_agent(ctx, batch):
            return [ctx, len(batch)]
    """, "agent.py"))
    assert asyncio.run(agent("c", [1, 2])) == ["c", 2]


def test_two_files_with_the_same_name_do_not_collide(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    f1 = load_reward_fn(_file(tmp_path / "a", "def reward_fn(r):\n    return 1.0\n", "reward.py"))
    f2 = load_reward_fn(_file(tmp_path / "b", "def reward_fn(r):\n    return 2.0\n", "reward.py"))
    assert (f1(None), f2(None)) == (1.0, 2.0) and f1.__module__ != f2.__module__


def test_missing_file(tmp_path):
    e = _error(load_reward_fn, str(tmp_path / "nope.py"))
    assert e.flag == "--reward-fn-path" and str(e).startswith("--reward-fn-path file not found:")
    assert "nope.py" in str(e)
    e = _error(load_dataset_loader, str(tmp_path))
    assert str(e).startswith("--dataset-loader-fn") and "is not a file" in str(e)


def test_import_failure_reports_type_message_and_line(tmp_path):
    e = _error(load_reward_fn, _file(tmp_path, "x = 1\nraise RuntimeError('boom here')\n"))
    assert str(e).startswith("--reward-fn-path") and "failed to import" in str(e)
    assert "RuntimeError: boom here (line 2)" in str(e)
    e = _error(load_reward_fn, _file(tmp_path, "def reward_fn(r)\n    return 1\n", "syntax.py"))
    assert "SyntaxError" in str(e) and "(syntax.py, line 1)" in str(e) and str(e).count("line 1") == 1
    e = _error(load_reward_fn, _file(tmp_path, "import areno_no_such_module_xyz\n", "dep.py"))
    assert "ModuleNotFoundError: No module named 'areno_no_such_module_xyz'" in str(e)


def test_missing_function_lists_what_the_file_defines(tmp_path):
    e = _error(load_reward_fn, _file(tmp_path, """
        def score(record):
            return 1.0

        def _private():
            pass
    """))
    assert str(e).startswith("--reward-fn-path") and "has no function 'reward_fn' (it defines score)" in str(e)
    e = _error(load_dataset_loader, _file(tmp_path, "X = 1\n", "empty.py"))
    assert "has no function 'load_training_dataset' (it defines no functions)" in str(e)


def test_not_callable(tmp_path):
    e = _error(load_reward_fn, _file(tmp_path, "reward_fn = 3\n"))
    assert str(e).startswith("--reward-fn-path") and "'reward_fn' is not callable (it is a int)" in str(e)


@pytest.mark.parametrize("loader,source,needle", [
    (load_reward_fn, "def reward_fn():\n    return 1.0\n", "must accept one positional argument"),
    (load_reward_fn, "def reward_fn(record, extra):\n    return 1.0\n", "must accept one positional argument"),
    (load_reward_fn, "async def reward_fn(record):\n    return 1.0\n", "is async; reward functions must be plain"),
    (load_dataset_loader, "def load_training_dataset(path):\n    return []\n", "default_loader as a keyword"),
    (load_dataset_loader, "def load_training_dataset(*, default_loader):\n    return []\n", "one positional path"),
    (load_agent, "def run_agent(ctx, batch):\n    return []\n", "is not a coroutine function; define it as `async"),
    (load_agent, "async def run_agent(ctx):\n    return []\n", "two positional arguments"),
])
def test_wrong_signatures(tmp_path, loader, source, needle):
    e = _error(loader, _file(tmp_path, source))
    flag = {load_reward_fn: "--reward-fn-path", load_dataset_loader: "--dataset-loader-fn",
            load_agent: "--agent-fn"}[loader]
    assert e.flag == flag and str(e).startswith(flag) and needle in str(e)


def test_flexible_signatures_are_accepted(tmp_path):
    load_reward_fn(_file(tmp_path, "def reward_fn(record, scale=1.0, **kw):\n    return scale\n"))
    load_reward_fn(_file(tmp_path, "def reward_fn(*args):\n    return 1.0\n", "var.py"))
    load_dataset_loader(_file(tmp_path, "def load_training_dataset(path, **kwargs):\n    return []\n", "kw.py"))


def test_load_function_custom_check(tmp_path):
    path = _file(tmp_path, "def f(x):\n    return x\n")
    assert load_function(path, "f", flag="--x")(2) == 2
    with pytest.raises(PluginError, match=r"^--x .*f\(x\) is not allowed"):
        load_function(path, "f", flag="--x", check=lambda fn: "is not allowed")

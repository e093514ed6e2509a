"""User plugin files (docs/design.md "Plugin interfaces"), loaded by path and checked before any GPU work.

- ``--dataset-loader-fn FILE``: ``load_training_dataset(path, *, default_loader, **kwargs)`` returning rows.
- ``--reward-fn-path FILE``: ``reward_fn(record) -> float`` (synchronous).
- ``--agent-fn FILE``: ``async def run_agent(ctx, batch)``.

Every problem (missing file, import failure, missing function, not callable, wrong signature) raises ``PluginError``
whose message starts with the flag, so the CLI can exit 2 with a line that names what to fix.

A reward or agent call that outlives its timeout is abandoned on its thread (Python cannot stop a thread);
``stuck_calls`` counts those threads while they live, and once ``STUCK_CALL_LIMIT`` are stuck no further call is
started (its sample fails) and the loop stops the run, so a hanging plugin cannot leak threads without bound.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import itertools
import sys
import threading
import traceback
from pathlib import Path

from areno.config import ConfigError

_counter = itertools.count()

STUCK_CALL_LIMIT = 32  # plugin calls left running past their timeout before the run stops


class StuckCalls:
    """The threads of abandoned plugin calls that still run (a thread leaves the count when it ends)."""

    def __init__(self):
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()

    def add(self, thread: threading.Thread) -> None:
        with self._lock:
            self._threads.add(thread)

    def count(self) -> int:
        with self._lock:
            self._threads = {t for t in self._threads if t.is_alive()}
            return len(self._threads)

    def full(self) -> bool:
        """Whether no further call may be started: ``STUCK_CALL_LIMIT`` calls are stuck."""
        return self.count() >= STUCK_CALL_LIMIT


stuck_calls = StuckCalls()


class PluginError(ConfigError):
    """A plugin file that cannot be used; ``flag`` names the CLI flag that pointed at it (a ValueError, like every
    ConfigError, so the CLI reports it as a bad flag)."""

    def __init__(self, flag: str, message: str):
        super().__init__(flag, message)  # str(e) == f"{flag} {message}"


def load_module(path, *, flag: str):
    """Import the file at ``path`` under a unique module name, its folder on ``sys.path`` during the import."""
    if path is None or str(path) == "":
        raise PluginError(flag, "needs a Python file path")
    p = Path(path).expanduser()
    if not p.exists():
        raise PluginError(flag, f"file not found: {path} (resolved to {p.resolve()})")
    if not p.is_file():
        raise PluginError(flag, f"{path} is not a file")
    p = p.resolve()
    digest = hashlib.sha1(str(p).encode()).hexdigest()[:8]
    name = f"areno_plugin_{_identifier(p.stem)}_{digest}_{next(_counter)}"
    spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or spec.loader is None:
        raise PluginError(flag, f"{path} cannot be imported as a Python module (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    folder = str(p.parent)
    sys.path.insert(0, folder)
    sys.modules[name] = module  # dataclasses, pickle and typing look the module up by name
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # a file that calls sys.exit() at import is a broken plugin too
        sys.modules.pop(name, None)
        raise PluginError(flag, f"{path} failed to import: {type(e).__name__}: {e}{_where(e, p)}") from e
    except BaseException:
        sys.modules.pop(name, None)
        raise
    finally:
        try:
            sys.path.remove(folder)
        except ValueError:
            pass
    return module


def load_function(path, name: str, *, flag: str, check=None):
    """The callable ``name`` from the file at ``path``; ``check(fn)`` returns a problem string or None."""
    module = load_module(path, flag=flag)
    if not hasattr(module, name):
        defined = [k for k, v in vars(module).items()
                   if inspect.isfunction(v) and v.__module__ == module.__name__ and not k.startswith("_")]
        listed = f"it defines {', '.join(defined)}" if defined else "it defines no functions"
        raise PluginError(flag, f"{path} has no function {name!r} ({listed})")
    fn = getattr(module, name)
    if not callable(fn):
        raise PluginError(flag, f"{path}: {name!r} is not callable (it is a {type(fn).__name__})")
    problem = check(fn) if check is not None else None
    if problem:
        raise PluginError(flag, f"{path}: {name}{_signature(fn)} {problem}")
    return fn


def _accepts(fn, *args, **kwargs) -> bool:
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError:
        return False
    except ValueError:  # no signature (some builtins): let the call decide
        return True
    return True


def _is_async(fn) -> bool:
    call = type(fn).__call__ if not inspect.isroutine(fn) else None  # an object with an async __call__
    return inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn) or inspect.iscoroutinefunction(call)


def _check_reward(fn):
    if _is_async(fn):
        return "is async; reward functions must be plain synchronous functions (use `def`, not `async def`)"
    if not _accepts(fn, object()):
        return "has the wrong signature: it must accept one positional argument, reward_fn(record) -> float"
    return None


def _check_loader(fn):
    if _is_async(fn):
        return "is async; load_training_dataset must be a plain synchronous function"
    if not _accepts(fn, "path", default_loader=object()):
        return ("has the wrong signature: it must be load_training_dataset(path, *, default_loader, **kwargs) "
                "(one positional path and default_loader as a keyword)")
    return None


def _check_agent(fn):
    if not inspect.iscoroutinefunction(fn):
        return "is not a coroutine function; define it as `async def run_agent(ctx, batch)`"
    if not _accepts(fn, object(), object()):
        return "has the wrong signature: it must accept two positional arguments, async def run_agent(ctx, batch)"
    return None


def load_reward_fn(path):
    return load_function(path, "reward_fn", flag="--reward-fn-path", check=_check_reward)


def load_answer_extractor(path):
    """The reward file's optional ``extract_answer(completion) -> str | None`` (the answer maj@K votes on), or
    None when the file defines none."""
    fn = getattr(load_module(path, flag="--reward-fn-path"), "extract_answer", None)
    if fn is None:
        return None
    if not callable(fn) or _is_async(fn) or not _accepts(fn, "completion"):
        raise PluginError("--reward-fn-path", f"{path}: extract_answer must be a plain function of one argument, "
                                              "extract_answer(completion) -> str | None")
    return fn


def load_dataset_loader(path):
    return load_function(path, "load_training_dataset", flag="--dataset-loader-fn", check=_check_loader)


def load_agent(path):
    return load_function(path, "run_agent", flag="--agent-fn", check=_check_agent)


def _identifier(stem: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in stem)


def _signature(fn) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return ""


def _where(e: BaseException, path: Path) -> str:
    """`` (line N)``: where in the user's file the import failed, when it did fail there."""
    if isinstance(e, SyntaxError) and e.lineno:  # its message already says "(file, line N)"
        return "" if f"line {e.lineno}" in str(e) else f" (line {e.lineno})"
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__, limit=10_000) if Path(f.filename) == path]
    return f" (line {lines[-1]})" if lines else ""

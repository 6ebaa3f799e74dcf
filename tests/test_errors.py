"""One error root: every exception class kvtier defines derives from `KvtierError`, which the
bottom layer (`kvtier.worker.errors`) defines and `kvtier.manager.errors` re-exports; the
errors that always had a built-in base keep it, so existing `except` clauses still work."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from types import ModuleType

import pytest
from kvtier.manager import errors as manager_errors
from kvtier.worker.errors import KvtierError

pytestmark = pytest.mark.fast

PACKAGES = ("kvtier.manager", "kvtier.worker", "kvtier.admin")


def _modules() -> list[ModuleType]:
    modules: list[ModuleType] = []
    for name in PACKAGES:
        pkg = importlib.import_module(name)
        modules.append(pkg)
        for info in pkgutil.walk_packages(pkg.__path__, prefix=f"{name}."):
            modules.append(importlib.import_module(info.name))
    return modules


def _exception_classes() -> dict[str, type[BaseException]]:
    """Every Exception subclass defined (not merely imported) in a kvtier module; warning
    categories (`warnings.warn`, never raised) are not errors."""
    found: dict[str, type[BaseException]] = {}
    for module in _modules():
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if (obj.__module__ == module.__name__ and issubclass(obj, Exception)
                    and not issubclass(obj, Warning)):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def test_the_root_is_one_class_defined_in_the_bottom_layer() -> None:
    assert manager_errors.KvtierError is KvtierError
    assert KvtierError.__module__ == "kvtier.worker.errors"


def test_every_exception_kvtier_defines_derives_from_kvtier_error() -> None:
    found = _exception_classes()
    # The walk really reaches every layer (a broken walk would pass vacuously).
    for name in ("kvtier.manager.config.base.ConfigError", "kvtier.worker.ipc.errors.IPCError",
                 "kvtier.worker.kv_pools.BlockIdError", "kvtier.admin.server.AdminBindError",
                 "kvtier.manager.launcher.WorkerStartError"):
        assert name in found, f"{name} not found by the module walk"
    strays = sorted(name for name, cls in found.items() if not issubclass(cls, KvtierError))
    assert not strays, f"exceptions not derived from KvtierError: {strays}"


@pytest.mark.parametrize(("name", "builtin"), [
    ("kvtier.manager.keys.TokenKeyError", ValueError),
    ("kvtier.manager.workloads.TraceError", ValueError),
    ("kvtier.worker.kv_pools.PoolConfigError", ValueError),
    ("kvtier.worker.kv_pools.BlockIdError", ValueError),
    ("kvtier.worker.ipc.IPCError", RuntimeError),
    ("kvtier.worker.ipc.ManagerGone", RuntimeError),
    ("kvtier.worker.ipc.SendTimeout", TimeoutError),
    ("kvtier.worker.ipc.LayerWaitTimeout", TimeoutError),
    ("kvtier.worker.executor.StorageError", RuntimeError),
    ("kvtier.admin.server.AdminBindError", OSError),
    ("kvtier.admin.server.AdminStartError", RuntimeError),
    ("kvtier.admin.auth.TokenFileError", OSError),
    ("kvtier.manager.errors.InvalidRequestError", ValueError),
    ("kvtier.manager.errors.UnknownRequestError", KeyError),
    ("kvtier.manager.errors.TransferTimeoutError", TimeoutError),
])
def test_errors_keep_their_builtin_base(name: str, builtin: type[Exception]) -> None:
    module, _, cls_name = name.rpartition(".")
    cls = getattr(importlib.import_module(module), cls_name)
    assert issubclass(cls, KvtierError) and issubclass(cls, builtin)

"""Run an unpatched Megatron-LM ``pretrain_gpt.py`` with the HDP hooks applied at runtime.

    python -m megatron_bytescale.launch /path/to/Megatron-LM/pretrain_gpt.py <Megatron flags> \\
        --hybrid-data-parallel --hdp-token-capacity 8K ...
    torchrun --nproc-per-node 8 -m megatron_bytescale.launch /path/to/pretrain_gpt.py ...

It does what the patch series does, without editing the checkout: ``pretrain_hooks.install()``
(HDP validation after Megatron's validate_args; the HDP step from get_forward_backward_func),
then it wraps ``megatron.training.pretrain`` so that the providers pretrain_gpt.py passes are
wrapped exactly as the patches wrap them (flags, model provider, datasets provider, forward
step with pretrain_gpt's own ``loss_func``), and runs the script as ``__main__``.

What it relies on (true for core_v0.16.1 and core_v0.19; the patch series does not):
pretrain_gpt.py takes ``pretrain`` from ``megatron.training`` when it is imported, its
``forward_step`` sees a module-level ``loss_func``, and (core_v0.19) its
``parse_and_validate_args`` parses through ``megatron.training.arguments.parse_args``. A script
that is already patched is run as is (its own calls install the same hooks).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path

from ..errors import ConfigError
from ..megatron_era import is_v019
from . import pretrain_hooks as hooks
from .preflight import check_entry_script

PATCH_MARKER = "megatron_bytescale.megatron import pretrain_hooks"
USAGE = (
    "usage: python -m megatron_bytescale.launch PRETRAIN_GPT_PY [Megatron and --hdp-* flags]\n"
    "Runs Megatron-LM's pretrain_gpt.py with the Hybrid Data Parallelism hooks installed at runtime "
    "(no patching). See docs/cluster.md."
)


def hdp_pretrain(pretrain: Callable) -> Callable:
    """Wrap Megatron's ``pretrain`` so its providers get the HDP hooks (idempotent). core_v0.16:
    ``pretrain(datasets_provider, model_provider, model_type, forward_step, ...,
    extra_args_provider=...)``; core_v0.19: ``pretrain(config_container, datasets_provider,
    model_type, forward_step, ...)`` after pretrain_gpt.py parsed the flags itself."""
    if getattr(pretrain, "_hdp_wrapped", False):
        return pretrain

    def forward_step(forward_step_func):
        return hooks.forward_step(forward_step_func, getattr(forward_step_func, "__globals__", {}).get("loss_func"))

    if is_v019():

        @functools.wraps(pretrain)
        def wrapped(cfg_container, train_valid_test_dataset_provider, model_type, forward_step_func, *args, **kwargs):
            if getattr(cfg_container, "model", None) is not None:
                hooks.model_config(cfg_container.model)
            return pretrain(
                cfg_container,
                hooks.datasets_provider(train_valid_test_dataset_provider),
                model_type,
                forward_step(forward_step_func),
                *args,
                **kwargs,
            )

    else:

        @functools.wraps(pretrain)
        def wrapped(
            train_valid_test_dataset_provider,
            model_provider,
            model_type,
            forward_step_func,
            *args,
            extra_args_provider: Callable | None = None,
            **kwargs,
        ):
            return pretrain(
                hooks.datasets_provider(train_valid_test_dataset_provider),
                hooks.model_provider(model_provider),
                model_type,
                forward_step(forward_step_func),
                *args,
                extra_args_provider=hooks.extra_args_provider(extra_args_provider),
                **kwargs,
            )

    wrapped._hdp_wrapped = True
    return wrapped


def hdp_parse_args(parse_args: Callable) -> Callable:
    """core_v0.19: Megatron's ``arguments.parse_args`` (called by the ``parse_and_validate_args``
    of pretrain_gpt.py) with the HDP flags added to the script's own (idempotent)."""
    if getattr(parse_args, "_hdp_wrapped", False):
        return parse_args

    @functools.wraps(parse_args)
    def wrapped(extra_args_provider=None, *args, **kwargs):
        return parse_args(hooks.extra_args_provider(extra_args_provider), *args, **kwargs)

    wrapped._hdp_wrapped = True
    return wrapped


def install_pretrain_wrapper() -> None:
    """Replace ``megatron.training.pretrain`` (what pretrain_gpt.py imports) with ``hdp_pretrain``,
    and on core_v0.19 Megatron's argument parser with ``hdp_parse_args``."""
    import megatron.training as training_package
    import megatron.training.training as training_module

    training_package.pretrain = hdp_pretrain(training_package.pretrain)
    training_module.pretrain = hdp_pretrain(training_module.pretrain)
    if is_v019():
        import megatron.training.arguments as arguments

        arguments.parse_args = hdp_parse_args(arguments.parse_args)


def run(script: str | Path, args: list[str]) -> None:
    """Run ``script`` as ``__main__`` with ``args`` and the HDP hooks installed."""
    path = Path(script)
    if not path.is_file() or path.suffix != ".py":
        raise ConfigError(f"{script}: not a Python file; give the path of Megatron-LM's pretrain_gpt.py")
    check_entry_script(path)
    path = path.resolve()
    patched = PATCH_MARKER in path.read_text()
    sys.path.insert(0, str(path.parent))  # pretrain_gpt.py imports gpt_builders, model_provider from its folder
    hooks.install()
    if not patched:
        install_pretrain_wrapper()
    sys.argv = [str(path), *args]
    run_as_main(path)


SPAWN_MAIN = "megatron_bytescale.megatron.spawn_main"


def run_as_main(path: Path) -> None:
    """Execute ``path`` as ``__main__`` (what ``runpy.run_path`` does), with ``__spec__`` naming
    ``spawn_main``: a child started with multiprocessing's "spawn" method then imports that
    module as its main module instead of re-running the unpatched script (see spawn_main.py)."""
    import builtins
    import importlib.machinery
    import types

    module = types.ModuleType("__main__")
    module.__file__ = str(path)
    module.__builtins__ = builtins
    module.__spec__ = importlib.machinery.ModuleSpec(SPAWN_MAIN, None)
    code = compile(path.read_text(), str(path), "exec")
    previous = sys.modules["__main__"]
    sys.modules["__main__"] = module
    try:
        exec(code, module.__dict__)
    finally:
        sys.modules["__main__"] = previous


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    try:
        run(argv[0], argv[1:])
    except ConfigError as exc:
        print(f"megatron_bytescale.launch: error: {exc}", file=sys.stderr)
        return 2
    return 0

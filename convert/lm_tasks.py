"""lm-evaluation-harness's tasks, checked before anything heavy is imported: the local tasks
shipped with the package (`convert/eval_tasks/`, no download) and lm_eval's own catalogue.

torch-free, so that `convert eval` refuses a missing lm_eval or an unknown task with one line
before its first progress line.
"""

import importlib.util
from functools import lru_cache
from pathlib import Path

from convert.errors import ConvertError, EnvironmentFailure

#: The local tasks: lm_eval task configs and their data, shipped with the package.
TASKS_DIR = Path(__file__).resolve().parent / "eval_tasks"
LOCAL_TASKS = ("convert_ppl", "convert_mc")
INSTALL = "pip install 'convert[eval]'"


def lm_eval_modules():
    """(lm_eval, its HFLM, its TaskManager); EnvironmentFailure, saying what to install, without it.
    HFLM imports torch and transformers."""
    try:  # imported here, not at the top: lm_eval is an optional dependency (the `eval` extra)
        import lm_eval
        from lm_eval.models.huggingface import HFLM
    except ImportError as err:
        raise _missing(err) from None
    return lm_eval, HFLM, _task_manager_class()


def _task_manager_class():
    """lm_eval's TaskManager, without the model classes (no torch)."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError as err:
        raise _missing(err) from None
    return TaskManager


def _missing(err: ImportError) -> EnvironmentFailure:
    return EnvironmentFailure(f"lm-evaluation-harness is not installed ({err}); {INSTALL}")


def check_tasks(tasks: list[str]) -> None:
    """Refuse what `task_manager` would, in a second: no task, lm_eval missing, or (only then
    indexing lm_eval's catalogue, ~20 s) a task that is not local and lm_eval does not have."""
    if tasks and all(task in LOCAL_TASKS for task in tasks):
        if importlib.util.find_spec("lm_eval") is None:
            raise EnvironmentFailure(f"lm-evaluation-harness is not installed; {INSTALL}")
        return
    task_manager(tasks)


def task_manager(tasks: list[str]):
    """lm_eval's TaskManager over the local tasks, and lm_eval's own catalogue when a task is not
    local; ConvertError, naming the task and the local ones, for a task neither knows. Built once
    per task list (indexing the catalogue takes ~20 s)."""
    if not tasks:
        raise ConvertError(f"--tasks: no task given; pass e.g. --tasks {','.join(LOCAL_TASKS)}")
    return _task_manager(tuple(tasks))


@lru_cache(maxsize=4)
def _task_manager(tasks: tuple[str, ...]):
    TaskManager = _task_manager_class()
    local = all(task in LOCAL_TASKS for task in tasks)
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=not local)
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        raise ConvertError(
            f"--tasks {','.join(unknown)}: no such lm_eval task; use the local ones ({', '.join(LOCAL_TASKS)}) "
            "or a task of `lm_eval ls tasks`"
        )
    return manager

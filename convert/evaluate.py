"""Evaluation with lm-evaluation-harness: the original and its conversions, side by side (docs/evaluation.md).

Each model is opened in the runtime it was made for (a vllm export computes vLLM's numbers, not stock transformers'),
one at a time. lm_eval is optional: `pip install 'convert[eval]'`.
"""

import json
import logging
from contextlib import contextmanager
from pathlib import Path

import datasets
import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from convert._version import __version__
from convert.errors import ConvertError
from convert.heap import release_freed_memory
from convert.hf import load_original
from convert.io import open_checkpoint
from convert.lm_tasks import LOCAL_TASKS, TASKS_DIR, lm_eval_modules, task_manager  # noqa: F401 (re-exported)
from convert.options import EVAL_TASKS, TORCH_DTYPES, EvalOptions, resolve_device
from convert.targets import load_output, written_by
from convert.text import model_tokenizer
from convert.verify.report import original_named_by

DEFAULT_MAX_LENGTH = 2048  # lm_eval's, for a config that names no context length


def packaged_dataset(builder: str, data_files: str, sample_by: str | None = None, **_metadata):
    """A local task's data, `data_files` in `TASKS_DIR`, read by datasets' local `builder` ("json",
    "text") as its test split: the tasks' `custom_dataset`, so that no path depends on the working
    directory. lm_eval also passes the task's metadata (version, ...), unused here."""
    options = {} if sample_by is None else {"sample_by": sample_by}
    return datasets.load_dataset(builder, data_files={"test": str(TASKS_DIR / data_files)}, **options)


def _config(path: Path) -> dict:
    config = path / "config.json"
    if not path.is_dir() or not config.is_file():
        raise ConvertError(f"{path}: no such model directory (no config.json); pass a directory with its config.json")
    try:
        return json.loads(config.read_text())
    except ValueError as err:
        raise ConvertError(f"{config}: not valid JSON ({err}); re-run the conversion") from None


def model_format(config: dict) -> str:
    """What wrote a directory: the target (`mla`, `transformers`, `vllm`; `convert.targets.written_by`),
    or `original` (a transformers checkpoint, not one of convert's outputs)."""
    return written_by(config) or "original"


def original_of(converted: list[Path], given=None) -> Path | None:
    """The original checkpoint: `given`, else the one the conversions' verification.json names
    (`inputs.original.path`); None when no directory is a conversion. ConvertError when they name
    none, or different ones."""
    if given is not None:
        return Path(given)
    named = {}
    for path in converted:
        found = original_named_by(path)
        if found is not None:
            named[found.resolve()] = found
    if len(named) > 1:
        raise ConvertError(
            f"{', '.join(map(str, converted))}: their verification.json name different originals "
            f"({', '.join(map(str, named.values()))}); pass --original PATH"
        )
    if not named and converted:
        raise ConvertError(
            f"{converted[0]}: no --original given and no verification.json naming an existing original "
            "checkpoint; pass --original PATH (the GQA checkpoint it was converted from)"
        )
    return next(iter(named.values()), None)


def load_model(path: Path, device, dtype: torch.dtype):
    """A directory as its runtime computes it: a conversion through `load_output`, an original
    checkpoint as transformers builds it (the model verification compares against)."""
    config = _config(path)
    if model_format(config) != "original":
        return load_output(path, device, dtype)
    with open_checkpoint(path) as source:
        return load_original(source, source.config or config, device, dtype)


def byte_tokenizer(vocab_size: int, bos: int | None = None, eos: int | None = None):
    """A tokenizer for a checkpoint that has none (a random fixture): each ASCII character its
    code, as `convert.text` reads such a model's text (UTF-8 bytes; other characters become 0)."""
    size = min(vocab_size, 128)
    chars = {chr(i): i for i in range(size)}
    tokenizer = Tokenizer(models.WordLevel(chars, unk_token=chr(0)))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token a character
    tokenizer.decoder = decoders.Fuse()
    special = lambda i: chr(i if i is not None and i < size else 0)  # noqa: E731
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=special(bos), eos_token=special(eos), pad_token=chr(0)
    )


def tokenizer_for(path: Path, original: Path | None = None):
    """The directory's own tokenizer, else the original's, else `byte_tokenizer` with the original's
    special tokens (every model of a run reads the same token ids)."""
    for root in (path, original):
        if root is not None and root.is_dir():
            found = model_tokenizer(root)
            if found is not None:
                return found
    config = _config(original if original is not None else path)
    return byte_tokenizer(config["vocab_size"], config.get("bos_token_id"), config.get("eos_token_id"))


def context_length(config: dict) -> int:
    """The context length lm_eval gives every model of a run (the same rolling windows for all):
    the first model's (the original's) `max_position_embeddings`."""
    return int(config.get("max_position_embeddings") or DEFAULT_MAX_LENGTH)


def hflm(model, tokenizer, batch_size: int = 1, length: int | None = None):
    """lm_eval's HFLM over a loaded model (a causal LM: the MLA model's type is not in transformers'
    tables) and its tokenizer."""
    _, HFLM, _ = lm_eval_modules()
    return HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size, max_length=length)


@contextmanager
def _quiet_lm_eval():
    """lm_eval's warnings (a model passed as an object, a task's custom dataset) are for its own CLI."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def metrics(task_results: dict) -> dict:
    """{metric: value} from lm_eval's {"metric,filter": value}; stderrs lm_eval did not compute ("N/A"),
    the alias and the document count (`sample_len`, kept as the run's `samples`) are left out."""
    found = {}
    for key, value in task_results.items():
        name, _, _ = key.partition(",")
        if name not in ("alias", "sample_len") and isinstance(value, (int, float)):
            found[name] = float(value)
    return found


def _run_tasks(model, tokenizer, tasks, manager, limit, batch_size, length) -> tuple[dict, dict]:
    """lm_eval's figures on one model: ({task: {metric: value}}, {task: documents evaluated})."""
    lm_eval, _, _ = lm_eval_modules()
    lm = hflm(model, tokenizer, batch_size, length)
    out = lm_eval.simple_evaluate(
        model=lm, tasks=list(tasks), task_manager=manager, limit=limit, log_samples=False, bootstrap_iters=1000
    )
    figures = {task: metrics(out["results"][task]) for task in tasks}
    samples = {task: out.get("n-samples", {}).get(task, {}).get("effective") for task in tasks}
    return figures, samples


def evaluate(paths: list, tasks=EVAL_TASKS, *, original=None, **options) -> dict:
    """Run lm_eval tasks on the original checkpoint and on each directory of `paths`.

    paths: directories written by `convert gqa2mla` (native or an export), or any transformers
    checkpoint. original: the GQA checkpoint they were converted from (default: the one their
    verification.json names; evaluated first). tasks: lm_eval task names, a list or
    comma-separated. options: the other fields of `EvalOptions` (limit: documents per task, all by default; batch_size; device,
    auto = CUDA when present; dtype; max_length: lm_eval's context, the longest window of a
    rolling perplexity, default the original's `max_position_embeddings`). Models are loaded
    one at a time.
    Returns {"tasks", "models": [{"label", "path", "role", "format", "results": {task: {metric:
    value}}, "samples": {task: n}}], ...}: the original first; `render_markdown` shows it.
    """
    opts = EvalOptions.from_kwargs(tasks=tasks if isinstance(tasks, str) else ",".join(tasks), **options)
    lm_eval_modules()  # refuse a missing lm_eval before anything is read
    if not paths and original is None:
        raise ConvertError("no directory to evaluate; pass the converted directories (and --original)")
    tasks, limit, batch_size, dtype = opts.task_names, opts.limit, opts.batch_size, opts.dtype
    entries, source = _models([Path(p) for p in paths], original)
    manager = task_manager(tasks)
    torch_device, torch_dtype = resolve_device(opts.device), TORCH_DTYPES[dtype]
    length = opts.max_length or context_length(_config(entries[0][0]))
    models = []
    with _quiet_lm_eval():
        for path, role in entries:
            model = load_model(path, torch_device, torch_dtype)
            figures, samples = _run_tasks(model, tokenizer_for(path, source), tasks, manager, limit, batch_size, length)
            del model
            release_freed_memory()
            about = {"label": path.name or str(path), "path": str(path), "role": role}
            models.append(about | {"format": model_format(_config(path)), "results": figures, "samples": samples})
    return {
        "tasks": tasks,
        "limit": limit,
        "batch_size": batch_size,
        "device": str(torch_device),
        "dtype": dtype,
        "max_length": length,
        "models": models,
        "versions": _versions(),
    }


def _models(paths: list[Path], original) -> tuple[list[tuple[Path, str]], Path | None]:
    """(directory, role) of each model to run, the original first, and the original (None when no
    directory is a conversion and none is given). Every directory is checked before any is loaded."""
    formats = {path: model_format(_config(path)) for path in paths}
    source = original_of([path for path in paths if formats[path] != "original"], original)
    if source is None:
        return [(path, "model") for path in paths], None
    _config(source)
    rest = [path for path in paths if path.resolve() != source.resolve()]
    return [(source, "original")] + [(p, "converted" if formats[p] != "original" else "model") for p in rest], source


def _versions() -> dict:
    lm_eval, _, _ = lm_eval_modules()
    return {
        "convert": __version__,
        "lm_eval": lm_eval.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def _cell(value) -> str:
    return "—" if value is None else f"{value:.6g}"


def render_markdown(results: dict) -> str:
    """The side-by-side table: a row per task and metric, a column per model (the original first),
    and after each other model its ratio to the original on the perplexities."""
    models = results["models"]
    base = models[0] if models and models[0]["role"] == "original" else None
    header = ["task", "metric"]
    for model in models:
        header.append(f"{model['label']} ({'original' if model is base else model['format']})")
        if base is not None and model is not base:
            header.append("ratio")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for task in results["tasks"]:
        names = list(dict.fromkeys(name for model in models for name in model["results"].get(task, {})))
        for name in (n for n in names if not n.endswith("_stderr")):
            row = [task, name]
            for model in models:
                value = model["results"].get(task, {}).get(name)
                row.append(_cell(value))
                if base is not None and model is not base:
                    reference = base["results"].get(task, {}).get(name)
                    ratio = value / reference if "perplexity" in name and value and reference else None
                    row.append("—" if ratio is None else f"{ratio:.6f}")
            lines.append("| " + " | ".join(row) + " |")
    samples = (
        ", ".join(f"{task}: {models[0]['samples'].get(task)} documents" for task in results["tasks"]) if models else ""
    )
    lines += ["", f"lm_eval {results['versions']['lm_eval']}, {results['dtype']} on {results['device']}; {samples}."]
    return "\n".join(lines) + "\n"

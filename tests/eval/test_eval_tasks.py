"""The local lm_eval tasks (convert/eval_tasks/) ship with the package, load without a network
(datasets' local builders on files inside the package), and are what their configs say."""

# ruff: noqa: E402 (the imports follow the offline switches and the check for lm_eval)

import configparser
import fnmatch
import importlib.resources
import json
import os

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the local tasks never download
os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("lm_eval")

from convert.errors import ConvertError
from convert.evaluate import LOCAL_TASKS, TASKS_DIR, packaged_dataset, task_manager
from convert.options import EVAL_TASKS

from conftest import REPO


def test_the_task_files_are_package_data():
    shipped = sorted(f.name for f in (importlib.resources.files("convert") / "eval_tasks").iterdir())
    assert shipped == ["convert_mc.yaml", "convert_ppl.yaml", "emma_chapter1.txt", "emma_cloze.jsonl"]
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    patterns = [p.strip().removeprefix("eval_tasks/") for p in config["options.package_data"]["convert"].split(",")]
    assert all(any(fnmatch.fnmatch(name, p) for p in patterns) for name in shipped), (shipped, patterns)


def test_the_cli_offers_the_local_tasks():
    assert EVAL_TASKS.split(",") == list(LOCAL_TASKS)


def test_the_held_out_text_is_a_few_kb_of_emma_in_paragraphs():
    paragraphs = packaged_dataset("text", "emma_chapter1.txt", sample_by="paragraph")["test"]["text"]
    assert len(paragraphs) == 9 and paragraphs[0].startswith("Emma Woodhouse, handsome, clever, and rich")
    text = (TASKS_DIR / "emma_chapter1.txt").read_text()
    assert 4000 < len(text.encode()) < 8000 and text.isascii()  # ASCII: the byte tokenizer reads it whole


@pytest.mark.realdata
def test_the_held_out_text_is_verbatim_emma():
    realdata = pytest.importorskip("realdata")
    assert (TASKS_DIR / "emma_chapter1.txt").read_text() in realdata.austen_text("emma")


def test_the_multiple_choice_items_are_well_formed():
    items = [json.loads(line) for line in (TASKS_DIR / "emma_cloze.jsonl").read_text().splitlines()]
    assert len(items) == 32
    assert all(len(set(item["choices"])) == 4 and 0 <= item["answer"] < 4 for item in items)
    assert sorted({item["answer"] for item in items}) == [0, 1, 2, 3]  # the right answer is not always first
    loaded = packaged_dataset("json", "emma_cloze.jsonl")["test"]
    assert loaded.num_rows == 32 and loaded[0] == items[0]


def test_the_task_manager_finds_the_local_tasks():
    assert set(LOCAL_TASKS) <= set(task_manager(list(LOCAL_TASKS)).all_tasks)
    with pytest.raises(ConvertError, match="no task given"):
        task_manager([])


@pytest.mark.slow
def test_the_task_manager_refuses_a_task_lm_eval_does_not_have():
    """Not a local task: lm_eval's own catalogue is searched too (~10 s to index)."""
    with pytest.raises(ConvertError, match=r"^tasks no_such_task: no such lm_eval task; use the local ones"):
        task_manager(["no_such_task"])

"""``[[tasks]]``: reading, checking and the per-task streams (no Ray, no torch except where a model is named)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from flexorch.config import ConfigError
from flexorch.config.adapters import target_modules
from flexorch.config.load import config_from_dict
from flexorch.config.tasks import batch_counts
from flexorch.data.corpus import Corpus
from flexorch.data.task_corpus import TaskStreams, combine_corpora, task_fields
from flexorch.work.step import DocRef, GroupWork, StepWork, step_work


def run_file(tasks, **extra):
    return {"workers": 4, "batch_size": 8, "data": {"max_context": 512}, "tasks": tasks, **extra}


THREE = [
    {"name": "chat", "source": "examples/data/chat_stdlib.jsonl", "share": 0.5, "lora_rank": 4, "weight": 2.0},
    {"name": "code", "share": 0.25, "lora_rank": 2, "lora_targets": ["wq", "w2"]},
    {"name": "prose", "share": 0.25, "lora_rank": 8, "lora_alpha": 4, "extensions": [".txt"]},
]


def test_tasks_are_read_with_the_run_data_as_defaults_and_adapters_reach_the_model():
    cfg = config_from_dict(run_file(THREE))
    assert [t.name for t in cfg.tasks] == ["chat", "code", "prose"]
    chat, code, prose = cfg.tasks
    assert chat.data.source == "examples/data/chat_stdlib.jsonl" and code.data.source is None
    assert all(t.data.max_context == 512 and t.data.tokenizer == "byte" for t in cfg.tasks)  # the run's, resolved
    assert prose.data.extensions == (".txt",)
    assert cfg.task_counts == (4, 2, 2)
    specs = {s.task: s for s in cfg.model.adapters}
    assert specs["chat"].targets == ("wq", "wv") and specs["chat"].rank == 4  # LoRA's default: q and v
    assert specs["code"].targets == ("wq", "w2")
    assert specs["prose"].alpha == 4 and specs["chat"].alpha == 4  # alpha defaults to the rank (scale 1)
    # a saved config (TrainConfig.to_dict through JSON) reads back to the same run
    back = config_from_dict(json.loads(json.dumps(cfg.to_dict(), default=list)))
    assert back.tasks == cfg.tasks and back.model == cfg.model


def test_a_run_without_tasks_is_one_task_as_before():
    cfg = config_from_dict({"workers": 2})
    assert cfg.tasks == () and cfg.task_counts == () and cfg.model.adapters == ()


@pytest.mark.parametrize(
    ("tasks", "extra", "says"),
    [
        (
            [{**THREE[0], "share": 0.5}, {**THREE[1], "share": 0.3}],
            {},
            "shares must sum to 1: 0.5 (chat) + 0.3 (code) = 0.8",
        ),
        ([{**THREE[0], "share": 0.5}, {"name": "code", "lora_rank": 2}], {}, "give every task a share or none"),
        ([{"name": "a", "share": 0.95}, {"name": "b", "share": 0.05}], {}, "'b': share 0.05 of batch_size 8 is 0.40"),
        ([{"name": "chat", "lora_rank": 4, "lora_targets": ["qproj"]}], {}, "unknown LoRA target module 'qproj'"),
        ([{"name": "chat"}, {"name": "chat"}], {}, "['chat'] appear more than once"),
        ([{"name": "chat-1"}], {}, "name must be a name like"),
        ([{"name": "chat", "lora_rank": 0}], {"model": {"base_trainable": False}}, "would train nothing"),
        ([], {"model": {"base_trainable": False}}, "leaves nothing to train"),
        ([{"name": "chat", "max_context": 64}], {}, "are the run's, shared by every task"),
        ([{"name": "chat", "text_feld": "x"}], {}, "unknown keys ['text_feld']"),
        ([{"name": "chat", "weight": 0}], {}, "weight must be a number > 0"),
        ([{"name": "chat", "lora_alpha": 8}], {}, "need an adapter: set lora_rank > 0"),
        ([{"name": "chat"}], {"pipeline": {"stages": 2}}, "pipeline stages with several tasks are not supported"),
        ([{"name": "chat"}], {"plan": {"mode": "static-ring-2"}}, "set plan.mode = 'adaptive'"),
        ([{"share": 1.0}], {}, "needs a name"),
    ],
)
def test_bad_task_definitions_fail_when_the_file_is_read_saying_what_to_change(tasks, extra, says):
    with pytest.raises(ConfigError) as e:
        config_from_dict(run_file(tasks, **extra))
    assert says in str(e.value)


def test_batch_counts_round_by_largest_remainder_and_sum_to_the_batch():
    class T:
        def __init__(self, name, share):
            self.name, self.share = name, share

    assert batch_counts([T("a", 1 / 3), T("b", 1 / 3), T("c", 1 / 3)], 16) == (6, 5, 5)
    assert batch_counts([T("a", None), T("b", None)], 5) == (3, 2)
    assert sum(batch_counts([T("a", 0.7), T("b", 0.2), T("c", 0.1)], 13)) == 13


def test_lora_targets_come_from_the_model_shape_without_torch():
    cfg = config_from_dict({"workers": 2})
    assert target_modules(cfg.model) == ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


def _corpus(n_docs: int, start_len: int, blocks: int = 2) -> Corpus:
    lengths = np.arange(start_len, start_len + n_docs, dtype=np.int64)
    return Corpus(
        keys=[f"d{i}" for i in range(n_docs)],
        lengths=lengths,
        doc_blocks=np.arange(n_docs) % blocks,
        doc_offsets=np.zeros(n_docs, dtype=np.int64),
        blocks=[f"ref{start_len}-{b}" for b in range(blocks)],
        stats={"documents": n_docs, "tokens": int(lengths.sum()), "source": f"s{start_len}"},
        tokenizer_name="byte",
        vocab_size=257,
    )


def test_combined_corpus_keeps_each_task_in_its_own_id_range_and_blocks():
    c = combine_corpora([_corpus(5, 10), _corpus(3, 100, blocks=1)], ["a", "b"])
    assert c.num_docs == 8 and c.task_names == ("a", "b")
    assert c.task_of.tolist() == [0] * 5 + [1] * 3
    assert c.blocks == ["ref10-0", "ref10-1", "ref100-0"]
    refs = c.locate([4, 5])
    assert (refs[0].task, refs[0].block, refs[0].length) == (0, 0, 14)
    assert (refs[1].task, refs[1].block, refs[1].length) == (1, 2, 100)  # block index shifted past task a's
    assert c.stats["tasks"]["b"]["source"] == "s100" and c.stats["documents"] == 8


def test_task_streams_see_every_document_of_each_task_once_per_epoch_of_that_task():
    c = combine_corpora([_corpus(10, 10), _corpus(3, 100)], ["big", "small"])
    streams = TaskStreams(c, (4, 1), seed=7)
    seen = Counter()
    for _ in range(6):  # small: 2 epochs; big: 2.4 epochs
        b = streams.next_batch()
        tasks = c.task_of[list(b.doc_ids)].tolist()
        assert tasks.count(1) == 1 and 1 <= tasks.count(0) <= 4
        seen.update(b.doc_ids)
    assert all(seen[i] == 2 for i in (10, 11, 12))  # the small task: exactly twice each
    assert all(seen[i] == 2 for i in range(10))  # the big task: 4 + 4 + 2 (its epoch's end) twice
    # resume: the state holds each task's stream; a fresh stream continues at the exact next documents
    state = json.loads(json.dumps(streams.state_dict()))
    again = TaskStreams(c, (4, 1), seed=7)
    again.load_state_dict(state)
    assert again.peek() == streams.peek() and again.peek_after() == streams.peek_after()
    assert streams.peek_after().step == streams.peek().step + 1
    with pytest.raises(ValueError, match="saved for tasks"):
        TaskStreams(combine_corpora([_corpus(10, 10)], ["big"]), (4,)).load_state_dict(state)


def _doc(i, task, length=9, targets=None):
    return DocRef(i, 0, 0, length, targets, task)


def test_a_group_runs_one_task_and_the_loss_scales_weigh_each_task_by_its_own_targets():
    with pytest.raises(ValueError, match="mixes documents of tasks"):
        GroupWork(0, (0,), "ulysses", (_doc(0, 0), _doc(1, 1)))

    class P:  # a plan of 2 groups on 2 ranks, one micro-batch
        class G:
            def __init__(self, ranks, seq_ids):
                self.ranks, self.seq_ids, self.kind, self.degree = ranks, seq_ids, "ulysses", len(ranks)
                self.ulysses_degree = None

        class MB:
            def __init__(self, groups):
                self.groups = groups

        seq_lengths = (9, 9, 5)
        num_devices = 2
        micro_batches = (MB((G((0,), (0, 1)), G((1,), (2,)))),)

    docs = [_doc(0, 0), _doc(1, 0, targets=4), _doc(2, 1, length=5)]
    tasks = step_work(P, docs, 3, None, ("a", "b"), (3.0, 1.0))
    t0 = tasks[0]
    assert t0.task_predicted == (12, 4) and t0.num_predicted == 16 and t0.task_weights == (0.75, 0.25)
    # scaled sums divided by num_predicted: 0.75 * sum_a / 12 + 0.25 * sum_b / 4
    assert t0.loss_scale(0) * 1 / 16 == pytest.approx(0.75 / 12) and t0.loss_scale(1) / 16 == pytest.approx(0.25 / 4)
    assert step_work(P, [_doc(0, 0), _doc(1, 0), _doc(2, 0, length=5)], 3)[0].loss_scale(0) == 1.0
    with pytest.raises(ValueError, match="do not sum to num_predicted"):
        StepWork(0, 0, 1, (), (), 10, 0, ("a",), (1.0,), (9,))


def test_step_records_get_per_task_documents_tokens_targets_and_losses():
    class T:
        def __init__(self, name):
            self.name = name

    docs = [_doc(0, 0), _doc(1, 1, length=5, targets=2)]
    out = task_fields([T("a"), T("b")], docs, {"a": 1.5, "b": 2.5}, {"a": 0, "b": 3})
    assert out == {
        "a": {"docs": 1, "tokens": 9, "targets": 8, "loss": 1.5, "epoch": 0},
        "b": {"docs": 1, "tokens": 5, "targets": 2, "loss": 2.5, "epoch": 3},
    }

"""Reports on the wire carry what a reader needs (replysize.wire_report): an entry's optional
keys are left out only when empty, and every key the contract lists for an entry stays."""

from __future__ import annotations

from typing import Any

from gpuguardd.bus import marshal, replysize


def report() -> dict[str, Any]:
    return {
        "id": "a" * 32, "outcome": "freed", "scope": {"gpus": [], "unit": "", "container": ""},
        "targets": [
            {"pid": 10, "comm": "python3", "unit": "", "container": "", "kind": "compute",
             "gpus": [0], "gpu_memory": 0, "exe": "/usr/bin/python3"},
            {"pid": 11, "comm": "vllm", "unit": "vllm.service", "container": "docker/3f2a",
             "kind": "compute", "gpus": [], "gpu_memory": 5, "exe": "", "mig": ["MIG-1"]},
        ],
        "terminated": [{"pid": 10, "comm": "python3", "unit": "", "signal": "",
                        "exited_after_ms": 0}],
        "survived": [{"pid": 12, "comm": "x", "unit": "", "state": "", "why": "zombie"}],
        "spared": [{"pid": 13, "comm": "y", "unit": "", "why": "protected"}],
        "gpus": [{"index": 0, "uuid": "", "memory_used_before": 0, "memory_used_after": 0,
                  "memory_total": 0, "released": False, "mig_uuid": ""}],
        "leaks": [{"gpu": 0, "uuid": "GPU-1", "bytes": 1, "mig_uuid": "MIG-2"}],
        "warnings": [], "error": "",
    }


def test_empty_optional_keys_are_left_out_of_entries_only() -> None:
    sent = replysize.wire_report(report())
    assert sent["targets"][0] == {"pid": 10, "comm": "python3", "kind": "compute", "gpus": [0],
                                  "gpu_memory": 0, "exe": "/usr/bin/python3"}
    # Not empty: kept, whatever the key. A GPU list is never optional (gpus [] stays).
    assert sent["targets"][1] == {k: v for k, v in report()["targets"][1].items() if k != "exe"}
    assert sent["targets"][1]["gpus"] == []
    # Keys docs/contract.md lists for an entry stay, empty or not.
    assert sent["terminated"] == report()["terminated"]
    assert sent["survived"] == [{"pid": 12, "comm": "x", "state": "", "why": "zombie"}]
    assert sent["spared"] == [{"pid": 13, "comm": "y", "why": "protected"}]
    assert sent["gpus"][0]["uuid"] == "" and "mig_uuid" not in sent["gpus"][0]
    assert sent["leaks"] == report()["leaks"]
    # The report's own keys and scope are never trimmed.
    assert {k: v for k, v in sent.items() if k not in replysize.OMITTED_WHEN_EMPTY} == \
        {k: v for k, v in report().items() if k not in replysize.OMITTED_WHEN_EMPTY}


def test_the_sent_report_is_smaller_and_the_original_untouched() -> None:
    original = report()
    typed, size = replysize.bound_report(original)
    assert original == report()
    assert set(typed["targets"].value[0]) == {"pid", "comm", "kind", "gpus", "gpu_memory", "exe"}
    assert size < replysize.wire_size(marshal.report(report()))


def test_odd_shapes_pass_through() -> None:
    # history.jsonl is untrusted: entries that are not dicts, lists that are not lists.
    odd = {"id": "b", "targets": ["text", 3, {"unit": ""}], "spared": "nope"}
    assert replysize.wire_report(odd) == {"id": "b", "targets": ["text", 3, {}], "spared": "nope"}

"""What a resumed federated server reads back, and what it says of runs written by earlier versions."""

from __future__ import annotations

import logging

from federation.programs.resume import note_file_weights


def test_a_pretraining_run_that_weighted_clients_by_files_resumes_saying_what_changed(caplog):
    with caplog.at_level(logging.WARNING, logger="geofm.fl"):
        assert note_file_weights({"round": 3, "clients": ["a"]}, "pretraining", "run/rounds.jsonl")
    assert "rounds up to 3 weighted each client by its number of files; from round 4 on" in caplog.text
    assert "run/rounds.jsonl" in caplog.text and "Start a new run.output_dir" in caplog.text


def test_runs_that_record_examples_or_finetune_resume_silently(caplog):
    with caplog.at_level(logging.WARNING, logger="geofm.fl"):
        assert not note_file_weights({"round": 3, "examples": {"a": 256}}, "pretraining", "rounds.jsonl")
        assert not note_file_weights({"round": 3}, None, "rounds.jsonl")  # finetuning weighed labelled samples
        assert not note_file_weights(None, "pretraining", "rounds.jsonl")  # nothing done yet
    assert not caplog.text

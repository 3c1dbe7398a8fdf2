import json
import logging

import pytest

from slime.arguments import parse_args
from slime.rollout.data_source import DROP_MAX_PROMPT_LEN, DataError, RolloutDataSource, load_eval_groups, read_rows
from slime.utils.tiny_model import build_tokenizer
from slime.utils.types import Status

WORDS = list("0123456789=,-+ abcdefghijklmnopqrstuvwxyz?")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(WORDS)


def write_jsonl(path, rows, raw_lines=()):
    lines = [json.dumps(r) for r in rows] + list(raw_lines)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def args_for(tmp_path, data, *extra):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)  # no config.json: the context-length check is off
    return parse_args(["--hf-checkpoint", str(ckpt), "--rollout-batch-size", "2", "--prompt-data", data,
                       "--rm-type", "math", "--num-rollout", "3", *extra])


def rows(n):
    return [{"prompt": f"{10 + i}-3=", "label": str(7 + i), "metadata": {"id": f"p{i}"}} for i in range(n)]


def drawn(groups):
    return [(g[0].group_index, [s.index for s in g], g[0].metadata["row"], g[0].tokens) for g in groups]


def test_groups_shape_ids_and_tokens(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", rows(3))
    src = RolloutDataSource(args_for(tmp_path, path, "--label-key", "label", "--n-samples-per-prompt", "4"), tok)
    groups = src.get_groups(2) + src.get_groups(1)
    assert [len(g) for g in groups] == [4, 4, 4]
    assert [g[0].group_index for g in groups] == [0, 1, 2]
    assert [s.index for g in groups for s in g] == list(range(12))
    for i, g in enumerate(groups):
        assert {s.group_index for s in g} == {i}
        for s in g:
            assert s.status == Status.PENDING and s.response_length == 0
            assert s.tokens == tok(f"{10 + i}-3=")["input_ids"]
            assert s.prompt == f"{10 + i}-3="
            assert s.label == str(7 + i)
            assert s.metadata["id"] == f"p{i}" and s.metadata["row"] == i
    # deep copies: growing one sample leaves its siblings alone
    groups[0][0].append_response([4, 5], [-0.1, -0.2], 0)
    groups[0][0].metadata["x"] = 1
    assert groups[0][1].tokens == tok("10-3=")["input_ids"] and "x" not in groups[0][1].metadata
    assert src.get_groups(0) == []


def test_chat_template_string_and_messages(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "12-3="},
        {"prompt": [{"role": "system", "content": "a"}, {"role": "user", "content": "9-1="}]},
    ])
    src = RolloutDataSource(args_for(tmp_path, path, "--apply-chat-template"), tok)
    a, b = (g[0] for g in src.get_groups(2))
    assert a.prompt == "<bos>12-3=" and b.prompt == "<bos>a9-1="
    bos = tok.bos_token_id
    # the template already has BOS: it appears once, not twice
    assert a.tokens == [bos] + tok("12-3=", add_special_tokens=False)["input_ids"]
    assert b.tokens.count(bos) == 1 and b.tokens[0] == bos


def test_bos_added_once_with_a_bos_adding_tokenizer(tmp_path):
    from tokenizers import processors

    tok = build_tokenizer(WORDS)  # a tokenizer whose encode prepends BOS, like Llama's
    bos = tok.bos_token_id
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    assert tok("12")["input_ids"] == [bos] + tok("12", add_special_tokens=False)["input_ids"]
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "12-3="}])
    templated = RolloutDataSource(args_for(tmp_path, path, "--apply-chat-template"), tok).get_groups(1)[0][0]
    assert templated.tokens == tok("12-3=")["input_ids"] and templated.tokens.count(bos) == 1
    plain = RolloutDataSource(args_for(tmp_path, path), tok).get_groups(1)[0][0]
    assert plain.tokens == tok("12-3=")["input_ids"]  # a raw prompt gets the tokenizer's own special tokens


def test_messages_without_template_rejected(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1"}, {"prompt": [{"role": "user", "content": "9"}]}])
    with pytest.raises(DataError, match=r"d\.jsonl: line 2: key 'prompt'.*--apply-chat-template"):
        RolloutDataSource(args_for(tmp_path, path), tok)


def test_too_long_prompts_dropped_and_counted(tmp_path, tok, caplog):
    data = [{"prompt": "1" * n} for n in (2, 9, 4, 12, 5)]
    path = write_jsonl(tmp_path / "d.jsonl", data)
    with caplog.at_level(logging.INFO, logger="slime.rollout.data_source"):
        src = RolloutDataSource(args_for(tmp_path, path, "--rollout-max-prompt-len", "5"), tok)
    assert src.dropped_rows[DROP_MAX_PROMPT_LEN] == 2 and len(src) == 3
    assert "d.jsonl: line 2: dropped (over_max_prompt_len): 9 tokens > --rollout-max-prompt-len 5" in caplog.text
    assert "dropped 2 of 5 rows (over_max_prompt_len: 2)" in caplog.text
    assert [g[0].metadata["row"] for g in src.get_groups(3)] == [0, 2, 4]
    with pytest.raises(DataError, match="no usable prompts.*over_max_prompt_len: 2"):
        RolloutDataSource(args_for(tmp_path, write_jsonl(tmp_path / "e.jsonl", data[1:4:2]), "--rollout-max-prompt-len", "5"), tok)


def test_rows_the_engine_would_refuse_are_dropped_at_load_with_file_row_and_reason(tmp_path, tok, caplog):
    # the model's context: 16 positions; response budget 8 -> prompts over 8 tokens cannot be served
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"model_type": "qwen3", "max_position_embeddings": 16}))
    data = [{"prompt": "12-3="}, {"prompt": ""}, {"prompt": "1" * 9}, {"prompt": "  "}, {"prompt": "9-1="},
            {"prompt": "5-1=", "metadata": {"max_response_len": 2}} | {"prompt": "1" * 12}]
    path = write_jsonl(tmp_path / "d.jsonl", data)
    with caplog.at_level(logging.WARNING, logger="slime.rollout.data_source"):
        src = RolloutDataSource(args_for(tmp_path, path, "--rollout-max-response-len", "8"), tok)
    assert dict(src.dropped_rows) == {"empty_prompt": 2, "over_context_length": 1}
    assert "d.jsonl: line 3: dropped (over_context_length): 9 prompt tokens + 8 response budget > the model's 16" in caplog.text
    assert "d.jsonl: line 2: dropped (empty_prompt)" in caplog.text
    # a smaller per-row budget (metadata max_response_len) fits: 12 + 2 <= 16
    assert [g[0].metadata["row"] for g in src.get_groups(3)] == [0, 4, 5]
    assert src.offset == 6  # the position counts file rows, dropped ones included


def test_blank_prompts_are_dropped_even_inside_a_chat_template_and_every_drop_is_ledgered(tmp_path, tok):
    """A chat template wraps its markup around an empty prompt (tokens, but no question)."""
    from slime.rollout.buffer import PartialRolloutBuffer

    data = [{"prompt": "12-3="}, {"prompt": ""}, {"prompt": " \t "}, {"prompt": [{"role": "user", "content": "  "}]},
            {"prompt": "1" * 12}, {"prompt": "9-1="}]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in data[:2]) + "\n\n" + "\n".join(json.dumps(r) for r in data[2:]) + "\n")
    src = RolloutDataSource(args_for(tmp_path, str(path), "--apply-chat-template", "--rollout-max-prompt-len", "8"), tok)
    assert [g[0].metadata["row"] for g in src.get_groups(2)] == [0, 5]
    assert dict(src.dropped_rows) == {"empty_prompt": 3, "over_max_prompt_len": 1}
    # the blank line 3 counts: row 2 is on line 4
    assert src.dropped[1] == f"empty_prompt: the prompt is empty or whitespace ({path}: line 2, key 'prompt')"
    assert src.dropped[2].endswith(f"({path}: line 4, key 'prompt')") and src.dropped[3].startswith("empty_prompt: ")
    assert src.dropped[4].startswith("over_max_prompt_len: ") and f"{path}: line 6" in src.dropped[4]

    buf = PartialRolloutBuffer()
    buf.drop_rows(src.dropped)
    buf.save(str(tmp_path / "buffer.json"))
    saved = json.loads((tmp_path / "buffer.json").read_text())["ledger"]["rows_dropped"]
    assert saved == {str(r): why for r, why in src.dropped.items()}
    again = PartialRolloutBuffer()
    again.load(str(tmp_path / "buffer.json"))
    assert again.ledger.rows_dropped() == src.dropped and again.ledger_summary()["rows_dropped"] == 4


def test_every_row_error_names_the_file_line_and_key(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "1"}) + "\n\n\n" + json.dumps({"question": "2"}) + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl: line 4: missing key 'prompt' \(--input-key\)"):
        RolloutDataSource(args_for(tmp_path, str(path)), tok)
    (tmp_path / "a.json").write_text(json.dumps([{"prompt": "1"}, {"prompt": "2"}, {"q": 1}]))
    with pytest.raises(DataError, match=r"a\.json: row 3: missing key 'prompt'"):
        RolloutDataSource(args_for(tmp_path, str(tmp_path / "a.json")), tok)


def test_dropping_rows_never_shifts_the_saved_position(tmp_path, tok):
    """Adding --rollout-max-prompt-len on resume (to get past a bad row) keeps the order and the position."""
    data = [{"prompt": f"{i}-1="} for i in range(10, 16)]
    data[3] = {"prompt": "1" * 30}
    path = write_jsonl(tmp_path / "d.jsonl", data)
    before = RolloutDataSource(args_for(tmp_path, path, "--rollout-shuffle"), tok)
    before.get_groups(2)
    state = json.loads(json.dumps(before.state_dict()))
    expected = [g[0].metadata["row"] for g in before.get_groups(4)]
    after = RolloutDataSource(args_for(tmp_path, path, "--rollout-shuffle", "--rollout-max-prompt-len", "10"), tok)
    after.load_state_dict(state)
    got = [g[0].metadata["row"] for g in after.get_groups(3)]
    assert got == [r for r in expected if r != 3][:3]
    assert after.group_counter == state["group_counter"] + 3


def test_binary_data_file_is_named(tmp_path, tok):
    (tmp_path / "d.jsonl").write_bytes(b'{"prompt": "1"}\n\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR')
    with pytest.raises(DataError, match=r"d\.jsonl: line 2 is not UTF-8 text.*a binary"):
        RolloutDataSource(args_for(tmp_path, str(tmp_path / "d.jsonl")), tok)
    (tmp_path / "f.jsonl").write_bytes(b'{"prompt": "1"}\n\x00\x01\x02\n')
    with pytest.raises(DataError, match=r"f\.jsonl: line 2 holds NUL bytes: a binary file"):
        RolloutDataSource(args_for(tmp_path, str(tmp_path / "f.jsonl")), tok)
    (tmp_path / "e.jsonl").write_bytes(b'{"prompt": "\xff\xfe"}\n')
    with pytest.raises(DataError, match=r"e\.jsonl: line 1 is not UTF-8 text"):
        RolloutDataSource(args_for(tmp_path, str(tmp_path / "e.jsonl")), tok)


def test_epochs_in_order_without_shuffle(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", rows(3))
    src = RolloutDataSource(args_for(tmp_path, path), tok)
    got = [(src.epoch, g[0].metadata["row"], g[0].metadata["epoch"]) for g in (src.get_groups(1)[0] for _ in range(7))]
    # the epoch advances when a group is drawn past the end
    assert [r for _, r, _ in got] == [0, 1, 2, 0, 1, 2, 0]
    assert [e for _, _, e in got] == [0, 0, 0, 1, 1, 1, 2]
    assert src.epoch == 2


def test_shuffle_is_seeded_per_epoch(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", rows(20))

    def order(seed, epochs=3):
        src = RolloutDataSource(args_for(tmp_path, path, "--rollout-shuffle", "--rollout-seed", str(seed)), tok)
        return [[g[0].metadata["row"] for g in src.get_groups(20)] for _ in range(epochs)]

    a, b, c = order(1), order(1), order(2)
    assert a == b  # deterministic
    assert a != c  # depends on the seed
    for epoch in a:
        assert sorted(epoch) == list(range(20))  # each epoch is a permutation
    assert a[0] != a[1] != a[2] and a[0] != list(range(20))  # reshuffled every epoch


@pytest.mark.parametrize("shuffle", [False, True])
def test_state_dict_exact_resume(tmp_path, tok, shuffle):
    path = write_jsonl(tmp_path / "d.jsonl", rows(5))
    extra = ["--n-samples-per-prompt", "3"] + (["--rollout-shuffle"] if shuffle else [])
    src = RolloutDataSource(args_for(tmp_path, path, *extra), tok)
    src.get_groups(4)
    state = json.loads(json.dumps(src.state_dict()))  # survives a JSON round trip
    expected = drawn(src.get_groups(3) + src.get_groups(5))  # crosses into epochs 1 and 2
    fresh = RolloutDataSource(args_for(tmp_path, path, *extra), tok)
    fresh.load_state_dict(state)
    assert drawn(fresh.get_groups(3) + fresh.get_groups(5)) == expected
    assert fresh.state_dict() == src.state_dict()
    assert fresh.epoch == src.epoch == 2


def test_resume_with_different_data_refused(tmp_path, tok):
    src = RolloutDataSource(args_for(tmp_path, write_jsonl(tmp_path / "a.jsonl", rows(5))), tok)
    state = src.state_dict()
    other = RolloutDataSource(args_for(tmp_path, write_jsonl(tmp_path / "b.jsonl", rows(4))), tok)
    with pytest.raises(DataError, match="saved with 5 rows.*now has 4"):
        other.load_state_dict(state)
    with pytest.raises(DataError, match="missing"):
        other.load_state_dict({"epoch": 0})


@pytest.mark.parametrize(
    "row_objs, raw, extra, pattern",
    [
        (rows(1), ["{\"prompt\": \"1\", oops}"], [], r"d\.jsonl: line 2: invalid JSON"),
        (rows(1) + [{"prompt": 12}], [], [], r"d\.jsonl: line 2: key 'prompt' must be a string or a list of chat messages, got int"),
        (rows(1) + [{"prompt": [{"role": "user"}]}], [], ["--apply-chat-template"], r"line 2: key 'prompt': message 0 must be an object with string 'role' and 'content'"),
        (rows(2) + [{"question": "1"}], [], [], r"d\.jsonl: line 3: missing key 'prompt' \(--input-key\)"),
        (rows(1) + [{"prompt": "1"}], [], ["--label-key", "label"], r"d\.jsonl: line 2: missing key 'label' \(--label-key\)"),
        (rows(1) + [{"prompt": "1", "metadata": [1]}], [], [], r"d\.jsonl: line 2: key 'metadata': metadata must be an object"),
        (rows(1), ["[1, 2]"], [], r"d\.jsonl: line 2: expected a JSON object, got list"),
    ],
)
def test_bad_rows_named(tmp_path, tok, row_objs, raw, extra, pattern):
    path = write_jsonl(tmp_path / "d.jsonl", row_objs, raw)
    with pytest.raises(DataError, match=pattern):
        RolloutDataSource(args_for(tmp_path, path, *extra), tok)


def test_blank_lines_mixed_types_and_json_string_metadata(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    path.write_text(
        '{"prompt": "1", "label": 3}\n\n'
        '{"prompt": "2", "label": "1/2", "metadata": "{\\"k\\": 2}"}\n'
        '{"prompt": "3", "label": [1, 2], "metadata": null}\n'
    )
    src = RolloutDataSource(args_for(tmp_path, str(path), "--label-key", "label"), tok)
    got = [(g[0].label, g[0].metadata) for g in src.get_groups(3)]
    assert got == [(3, {"row": 0, "epoch": 0}), ("1/2", {"k": 2, "row": 1, "epoch": 0}), ([1, 2], {"row": 2, "epoch": 0})]


def test_custom_keys_and_parquet(tmp_path, tok):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"question": ["12-3=", "9-4="], "answer": ["9", "5"], "info": [{"src": "a"}, {"src": "b"}]}), path)
    src = RolloutDataSource(args_for(tmp_path, path, "--input-key", "question", "--label-key", "answer", "--metadata-key", "info"), tok)
    g = src.get_groups(2)
    assert [(x[0].prompt, x[0].label, x[0].metadata["src"]) for x in g] == [("12-3=", "9", "a"), ("9-4=", "5", "b")]
    assert g[1][0].tokens == tok("9-4=")["input_ids"]
    with pytest.raises(DataError, match=r"d\.parquet: row 1: missing key 'prompt' \(--input-key\)"):
        RolloutDataSource(args_for(tmp_path, path), tok)


def test_read_rows_file_errors(tmp_path):
    with pytest.raises(DataError, match="--prompt-data file not found: .*nope.jsonl"):
        read_rows(str(tmp_path / "nope.jsonl"))
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type"):
        read_rows(str(tmp_path / "d.csv"))
    (tmp_path / "arr.json").write_text(json.dumps(rows(2)))
    assert read_rows(str(tmp_path / "arr.json")) == [("row 1", rows(2)[0]), ("row 2", rows(2)[1])]


def test_eval_groups_use_their_own_ids(tmp_path, tok):
    train = write_jsonl(tmp_path / "train.jsonl", rows(3))
    ev = write_jsonl(tmp_path / "eval.jsonl", rows(4)[1:] + [{"prompt": "1" * 30, "label": "0"}])
    args = args_for(tmp_path, train, "--label-key", "label", "--rollout-max-prompt-len", "20")
    src = RolloutDataSource(args, tok)
    src.get_groups(2)
    before = src.state_dict()
    groups = load_eval_groups(args, tok, "held_out", ev, n_samples=2)
    assert src.state_dict() == before  # the training counters are untouched
    assert len(groups) == 3  # the over-long prompt is left out
    assert [g[0].group_index for g in groups] == [-1, -2, -3]
    ids = [s.index for g in groups for s in g]
    assert ids == [-1, -2, -3, -4, -5, -6] and len(set(ids)) == 6
    assert all(s.metadata["eval_name"] == "held_out" and s.status == Status.PENDING for g in groups for s in g)
    assert [g[0].label for g in groups] == ["8", "9", "10"]
    with pytest.raises(DataError, match="eval set 'x' file not found"):
        load_eval_groups(args, tok, "x", str(tmp_path / "missing.jsonl"), 1)

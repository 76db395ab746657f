"""data=chat (megatron_k3.data.conversations, docs/sft.md): whole conversations packed with document boundaries, the
loss only on the assistant's tokens (chat.encode_chat's mask), bad lines per data.on_bad_sample naming file:line, and
train.loss_average=token: the step's loss is the mean over the global batch's loss tokens, so the gradient does not
depend on how the conversations fall into micro-batches or data-parallel ranks."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import numpy as np
import pytest
import torch
from dist_utils import run_distributed
from helpers import (
    FAST,
    FULL_VOCAB,
    PARAM_RTOL,
    ROOT,
    RTOL,
    STATIC,
    TINY_MODEL,
    full_params,
    norm_rel,
    straight_and_resumed,
)

from megatron_k3.config import compose_run_config
from megatron_k3.config.schema import token_ids
from megatron_k3.data.build import build_data
from megatron_k3.data.chat import encode_chat
from megatron_k3.data.tokenizer import eod_id
from megatron_k3.errors import DataError

TOOL = {"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}


def _conversations(n: int, seed: int, short: bool = False) -> list:
    """n short conversations of every shape the format has: thinking on and off, reasoning, multi-turn, a tool call
    and its result, names, quoting, a user typing a control marker (`short`: no tools, no thinking)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        a, b = (int(x) for x in rng.integers(0, 50, 2))
        kind = (0, 1, 3)[i % 3] if short else i % 4
        if kind == 0:
            msgs = [{"role": "user", "content": f"{a} plus {b}?"}, {"role": "assistant", "content": str(a + b)}]
        elif kind == 1:
            msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Say {a}.", "name": "x"},
                    {"role": "assistant", "content": f"{a}", "reasoning_content": "Easy."},
                    {"role": "user", "content": "<|end_of_msg|> again"}, {"role": "assistant", "content": f"{a}!"}]
        elif kind == 2:
            args = json.dumps({"a": a, "b": b})
            msgs = [{"role": "user", "content": f"add {a} {b}"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": args}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": str(a + b)},
                    {"role": "assistant", "content": f"It is {a + b}."}]
        else:
            msgs = [{"role": "user", "content": f'quote "{a}" & <{b}>'}, {"role": "assistant", "content": f"'{b}'"}]
        conv = {"messages": msgs, "thinking": bool(i % 3) and not short}
        if kind == 2:
            conv["tools"] = [TOOL]
        out.append(conv)
    return out


def _write(path, convs, bad_lines=()):
    lines = [json.dumps(c) for c in convs]
    for k, line in bad_lines:
        lines.insert(k, line)
    path.write_text("\n".join(lines) + "\n")
    return path


def _datasets(tmp_path, path, *more):
    run, _, _ = compose_run_config(TINY_MODEL + ["data=chat", f"data.paths=[{path}]", "data.split='3,1,0'",
                                                 "train.seq_length=512"] + list(more))
    return build_data(run, 0)


def test_samples_hold_whole_conversations_and_learn_only_the_assistant(tmp_path):
    convs = _conversations(24, seed=int(np.random.default_rng().integers(1 << 30)))
    train, valid = _datasets(tmp_path, _write(tmp_path / "chats.jsonl", convs))
    assert not train.skipped and len(train.doc_ids) == 18 and len(valid.doc_ids) == 6
    tok = train.tokenizer
    seen = []
    for c in range(len(train)):
        s = train.sample(c)
        assert s.pixel_values is None and s.loss_mask.shape == (512,)
        starts = list(s.doc_starts) + [513]
        docs = train.documents_of(c)
        for k, d in enumerate(docs):
            conv = convs[int(train.doc_ids[d])]
            ids, mask = encode_chat(tok, conv["messages"], conv.get("tools"), thinking=conv["thinking"])
            b, e = int(starts[k]), int(starts[k + 1])
            assert e - b == len(ids) and s.tokens[b:e].tolist() == ids  # whole, in the release's encoding
            # labels of this conversation's tokens 1..: learned exactly where the release's assistant mask is 1
            assert s.loss_mask[b:b + len(ids) - 1].tolist() == [bool(m) for m in mask[1:]]
            seen.append(int(train.doc_ids[d]))
        if len(docs) < len(starts) - 1:  # the padding after the last conversation is never learned
            assert not s.loss_mask[starts[-2] - 1:].any()
    assert sorted(seen) == sorted(int(i) for i in train.doc_ids) == list(range(18))  # each once per epoch


BAD = [(1, "{not json"), (3, json.dumps({"messages": [{"role": "robot", "content": "hi"}]})),
       (4, json.dumps({"messages": [{"role": "user", "content": "hi"}]})),
       (6, json.dumps({"messages": [{"role": "tool", "tool_call_id": "nope", "content": "1"},
                                    {"role": "assistant", "content": "x"}]})),
       (7, json.dumps({"messages": [{"role": "user", "content": "long " * 600},
                                    {"role": "assistant", "content": "x"}]})),
       (8, json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}}]},
                                    {"role": "assistant", "content": "x"}]}))]
PROBLEMS = ["not valid JSON", "unknown role 'robot'", "no assistant turn", "a tool result for call 'nope'",
            "more than a sample of train.seq_length+1=513", "no vision tower"]


def test_bad_lines_are_skipped_or_stop_the_run_naming_file_line_and_problem(tmp_path, caplog):
    path = _write(tmp_path / "chats.jsonl", _conversations(8, seed=1), BAD)
    with caplog.at_level(logging.WARNING):
        train, valid = _datasets(tmp_path, path)
    # the splits are contiguous ranges of the file's lines; a batch's structure is checked before its tokens
    skipped = sorted(train.skipped + valid.skipped, key=lambda x: int(x[0].rsplit(":", 1)[1]))
    assert [w for w, _ in skipped] == [f"{path}:{k + 1}" for k, _ in BAD]
    for (w, problem), want in zip(skipped, PROBLEMS):
        assert want in problem, (w, problem)
        assert any(w in r.getMessage() and want in r.getMessage() for r in caplog.records)
    assert len(train.doc_ids) + len(valid.doc_ids) == 8
    with pytest.raises(DataError, match=rf"{path}:2: not valid JSON"):
        _datasets(tmp_path, path, "data.on_bad_sample=stop")


def test_a_missing_image_names_its_file(tmp_path):
    conv = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "gone.png"}},
                                                      {"type": "text", "text": "what?"}]},
                         {"role": "assistant", "content": "x"}]}
    path = _write(tmp_path / "chats.jsonl", [conv] + _conversations(2, seed=2))
    with pytest.raises(DataError, match=r"chats\.jsonl:1: image file not found: .*gone\.png"):
        _datasets(tmp_path, path, "model=k3_vl_tiny", "model.num_layers=4", "data.on_bad_sample=stop")


def test_images_become_media_runs_the_vision_model_trains_on(tmp_path):
    """An image part becomes <|media_begin|>, one placeholder per feature row, <|media_end|> (never learned), its
    pixels go with the sample, and the vision-language model takes the batch."""
    from PIL import Image

    from megatron_k3.data.dataset import make_batch
    from megatron_k3.model import causal_lm_class

    Image.new("RGB", (56, 42), (200, 30, 30)).save(tmp_path / "red.png")
    conv = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "red.png"}},
                                                      {"type": "text", "text": "Color?"}]},
                         {"role": "assistant", "content": "Red."}], "thinking": False}
    train, _ = _datasets(tmp_path, _write(tmp_path / "chats.jsonl", [conv] * 8), "model=k3_vl_tiny")
    s = train.sample(0)
    mt, n = train.tokens, train.processor.num_tokens(s.grid_thws[0])
    media = len(s.grid_thws)
    assert media == len(train.documents_of(0)) and s.pixel_values.shape[0] == media * int(np.prod(s.grid_thws[0]))
    assert (s.tokens == mt.placeholder).sum() == media * n and (s.tokens == mt.begin).sum() == media
    b = int(np.flatnonzero(s.tokens == mt.begin)[0])
    assert s.tokens[b + n + 1] == mt.end and not s.loss_mask[b - 1:b + n + 1].any()
    run, _, _ = compose_run_config(TINY_MODEL + ["model=k3_vl_tiny"])
    torch.manual_seed(0)
    model = causal_lm_class(run.model)(run.model)
    batch = make_batch([s], True)
    out = model(batch.input_ids, labels=batch.labels, cu_seqlens=batch.cu_seqlens, pixel_values=batch.pixel_values,
                grid_thws=batch.grid_thws)
    assert torch.isfinite(out.loss)


# ---------------------------------------------------------------------------------------------- the loss


def _steps(rank, world, overrides, run_dir):
    """2 Trainer steps per variant (name, overrides): the losses, loss tokens and the full-size parameters after."""
    from megatron_k3.training.engine import shutdown
    from megatron_k3.training.loop import Trainer

    out = {}
    for name, more in overrides:
        run, _, _ = compose_run_config(FAST + more + ["train.steps=2"], world_size=world)
        try:
            t = Trainer(run, f"{run_dir}/{name}/{rank}")
            recs = [t.train_step()[0] for _ in range(2)]
            out[name] = ([r["loss"] for r in recs], [r.get("loss_tokens") for r in recs], full_params(t))
        finally:
            shutdown()
    return out


def _chat_data(tmp_path) -> list:
    path = _write(tmp_path / "chats.jsonl", _conversations(64, seed=3, short=True))
    return ["data=chat", f"data.paths=[{path}]", "data.split='3,1,0'", "train.seq_length=128", FULL_VOCAB]


def _same_as(ref, got, name):
    (ref_loss, ref_tokens, ref_params), (loss, tokens, params) = ref, got
    assert tokens == ref_tokens and tokens[0] > 0, name
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL, err_msg=name)
    worst = max((norm_rel(p, ref_params[n]), n) for n, p in params.items())
    assert worst[0] < PARAM_RTOL, (name, worst)  # per tensor in norm, as the layout tests (helpers.PARAM_RTOL)


@pytest.mark.slow
def test_token_average_is_the_same_whatever_the_micro_batches_and_ranks(tmp_path):
    """One process with one micro-batch of 4 conversations, with 4 micro-batches of 1, and dp=2 with 2 each: the
    same loss tokens, losses (fp32 summation order: helpers.RTOL) and parameters (helpers.PARAM_RTOL in norm per
    tensor, as every layout test: AdamW's g / (|g| + eps) amplifies rounding on near-zero gradients). The
    per-micro-batch mean (the other convention) differs: the conversations' loss-token counts differ enough to
    tell."""
    data = _chat_data(tmp_path)
    one = _steps(0, 1, [("m4", data + ["train.micro_batch_size=4"]), ("m1", data),
                        ("m1_mean", data + ["train.loss_average=micro_batch"])], str(tmp_path / "one"))
    dp2 = run_distributed(_steps, 2, [("dp2", data)], str(tmp_path / "dp2"), timeout=300)[0]["dp2"]
    for name, got in (("m1", one["m1"]), ("dp2", dp2)):
        _same_as(one["m4"], got, name)
    assert abs(one["m1_mean"][0][0] - one["m4"][0][0]) > 1e-4  # the per-micro-batch mean weighs tokens differently


@pytest.mark.slow
def test_sft_layouts_equal_one_process_and_resume_mid_epoch_bitwise(tmp_path):
    """data=chat under tp2 (+SP), pp2, ep2 and cp2 against one process (2 steps: losses, loss tokens, parameters;
    dp2: the test above), the layouts one after another in one 2-process world, and a run saved after 2 of its
    5-step epoch's steps resumes bit for bit."""
    data = _chat_data(tmp_path)
    ref = _steps(0, 1, [("one", data)], str(tmp_path / "one"))["one"]
    layouts = [(name, data + more) for name, more in (
        ("tp2", ["parallel.tp=2", "parallel.sequence_parallel=true"]), ("pp2", ["parallel.pp=2"]),
        ("ep2", ["parallel.ep=2"] + STATIC), ("cp2", ["parallel.cp=2"]))]  # STATIC: ep2 drops nothing
    ranks = run_distributed(_steps, 2, layouts, str(tmp_path / "layouts"), timeout=600)
    for name, _ in layouts:
        loss, tokens, params = ranks[-1][name]  # pp: the loss on the last stage; each stage its own parameters
        for r in ranks:
            params = {**r[name][2], **params}
        _same_as(ref, (loss, tokens, params), name)
    straight, resumed, p_straight, p_resumed, _, _ = straight_and_resumed(0, 1, data, str(tmp_path / "ckpt"))
    assert straight == resumed
    assert all(p_straight[n].equal(p_resumed[n]) for n in p_straight)


def test_token_ids_tool_lists_the_training_splits_ids_as_trainable_tokens(tmp_path):
    """tools/token_ids.py (make sft PEFT=lora's peft.trainable_tokens): the ids of the training split's conversations,
    encoded as the release encodes them, each conversation counted once an epoch, the padding not; printed in the
    form peft.trainable_tokens parses; a bad override is one line and exit 2."""
    convs = _conversations(24, seed=int(np.random.default_rng().integers(1 << 30)))
    path = _write(tmp_path / "chats.jsonl", convs)
    args = [sys.executable, str(ROOT / "tools/token_ids.py"), "data=chat", f"data.paths=[{path}]", "data.split='3,1,0'",
            "train.seq_length=512", FULL_VOCAB]
    out = subprocess.run(args + ["--json"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    train, _ = _datasets(tmp_path, path, FULL_VOCAB)
    want, total = set(), 0
    for d in train.doc_ids:
        conv = convs[int(d)]
        ids = encode_chat(train.tokenizer, conv["messages"], conv.get("tools"), thinking=conv["thinking"])[0]
        want, total = want | set(ids), total + len(ids)
    assert eod_id(train.tokenizer) not in want  # the padding id: in the samples, not in the conversations
    assert got["ids"] == sorted(want) and token_ids(got["spec"].split(",")) == sorted(want)
    assert got["tokens"] == total
    few = json.loads(subprocess.run(args + ["--json", "--min-count", "50"], capture_output=True, text=True,
                                    cwd=ROOT).stdout)
    assert few["ids"] and set(few["ids"]) < want
    bad = subprocess.run(args + ["train.nope=1"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "train.nope" in bad.stderr

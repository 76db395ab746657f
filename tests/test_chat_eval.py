"""Chat evaluation (megatron_k3.training.chat_eval, tools/chat.py): greedy decoding with the KDA / MLA cache equals
decoding by re-running the whole sequence, every held-out kind's generation prompt is a prefix of its rendered
conversation, a perfect reply counts as an exact match, and tools/chat.py decodes a reply from a K3 directory."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import ROOT

from megatron_k3.config import load_model_config
from megatron_k3.data.chat import decode_reply
from megatron_k3.data.chat_set import EmbeddedChats
from megatron_k3.data.corpus import EmbeddedCorpus
from megatron_k3.interop import save_hf
from megatron_k3.model import K3ForCausalLM
from megatron_k3.model.generate import greedy
from megatron_k3.training.chat_eval import answer_ids, exact_match, load_for_inference, media_prompt, target_ids

TINY = ["num_layers=4", "hidden_size=64", "dense_intermediate_size=128", "attn_res_block_size=2"]


def _model(seed: int) -> K3ForCausalLM:
    torch.manual_seed(seed)
    return K3ForCausalLM(load_model_config("k3_tiny", TINY)).eval()


def test_cached_greedy_decoding_equals_rerunning_the_sequence():
    seed = int(np.random.default_rng().integers(1 << 20))
    model = _model(seed)
    prompt = torch.randint(0, 8192, (23,), generator=torch.Generator().manual_seed(seed)).tolist()
    got = greedy(model, prompt, stop_ids=[-1], max_new_tokens=12)
    ids, want = list(prompt), []
    with torch.no_grad():
        for _ in range(12):
            want.append(int(model(torch.tensor([ids]), return_logits=True).logits[0, -1].argmax()))
            ids.append(want[-1])
    assert got == want, seed
    assert greedy(model, prompt, stop_ids=[want[3]], max_new_tokens=12) == want[:want.index(want[3]) + 1]


class _Oracle(torch.nn.Module):
    """A 'model' whose next token is the reference reply's (to check that a perfect reply scores 1)."""

    def __init__(self, sequence):
        super().__init__()
        self.seq, self.w = sequence, torch.nn.Parameter(torch.zeros(1))

    def new_cache(self):
        return {"pos": 0}

    def forward(self, x, cache, return_logits=True):
        cache["pos"] += x.shape[1]
        logits = torch.full((1, x.shape[1], 8256), -1.0)
        logits[0, -1, self.seq[cache["pos"]] if cache["pos"] < len(self.seq) else 0] = 1.0
        return type("Out", (), {"logits": logits})


def test_held_out_targets_and_a_perfect_reply():
    tok = EmbeddedCorpus(None, 8192, progress=False).tokenizer()
    chats = EmbeddedChats()
    for i in range(6):  # every kind, thinking on and off: the prompt is a prefix (target_ids checks it)
        conv = chats.conversation(i)
        prompt, ref = target_ids(tok, conv)
        assert ref[-1] == tok.token_to_id("<|end_of_msg|>") and len(ref) > 3
        score, rows = exact_match(_Oracle(prompt + ref), tok, [conv])
        assert score == 1.0 and rows[0][2] == ref
        score, _ = exact_match(_Oracle(prompt + ref[:-2] + [5, 6]), tok, [conv])
        assert score == 0.0
        answer = answer_ids(tok, ref, conv["thinking"])  # after the think channel: the response, the tool calls
        assert tok.decode(answer).startswith("<|open|>response<|sep|>") if conv["thinking"] else answer == ref
    assert any(chats.conversation(i)["thinking"] for i in range(6))
    answer = chats.conversation(0)["messages"][-1]["content"]
    assert decode_reply(tok, target_ids(tok, chats.conversation(0))[1], thinking=False) == answer


def test_image_questions_decode_with_their_pixels_in_the_prefill():
    """A vision-language model's held-out image question: the prompt holds one placeholder per feature row of its
    image (as data=chat trains it) and the pixels go with the prefill."""
    from megatron_k3.model import causal_lm_class

    cfg = load_model_config("k3_vl_tiny", TINY)
    torch.manual_seed(1)
    model = causal_lm_class(cfg)(cfg).eval()
    tok = EmbeddedCorpus(None, 8192, progress=False).tokenizer()
    chats = EmbeddedChats(vision=True)
    conv = chats.conversation(3)
    prompt, media = media_prompt(model, tok, conv, chats.load)
    rows = int(np.prod(media["grid_thws"][0].tolist())) // 4  # the 2 x 2 merge
    assert prompt.count(cfg.vision.placeholder_token_id) == rows and media["pixel_values"].shape[0] == 4 * rows
    score, got = exact_match(model, tok, [conv], max_new_tokens=3, load=chats.load)
    assert score == 0.0 and len(got[0][2]) >= 1


def test_chat_tool_decodes_a_reply_from_a_k3_directory(tmp_path):
    save_hf(_model(0), tmp_path / "k3", layout="k3")
    r = subprocess.run([sys.executable, "tools/chat.py", str(tmp_path / "k3"), "--prompt", "What is 2 + 2?",
                        "--max-new-tokens", "4"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert '<|open|>message role="user"<|sep|>What is 2 + 2?<|close|>message' in r.stdout
    with pytest.raises(FileNotFoundError, match=r"nothing: no such directory"):
        load_for_inference(tmp_path / "nothing")

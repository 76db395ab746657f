#!/usr/bin/env python
"""Talk to a checkpoint in K3's chat format, or measure its exact-match on held-out conversations (docs/sft.md).

    python tools/chat.py DIR --prompt "What is 12 + 30?" [--system TEXT] [--no-thinking] [--max-new-tokens N]
    python tools/chat.py DIR --eval N [--seed S] [--out FILE]

DIR: a Hugging Face / K3 directory (checkpoint.export_hf, tools/convert_checkpoint.py --to-hf, the release) or a
training checkpoint (a step directory, or a checkpoint directory: its newest complete one). The tokenizer: DIR's
own (tiktoken.model + tokenizer_config.json) when it has one, else --tokenizer, else the embedded tokenizer with
K3's control tokens (the one data=chat trains with offline).

--prompt renders the conversation (printed with its control tokens), greedy-decodes the reply with the KDA / MLA
cache and prints it. --eval N decodes the last assistant turn of the first N conversations of the embedded chat
set's held-out split (data=chat's default split; a vision-language model's includes the questions about drawn
images, their pixels in the prefill) and prints one JSON line: the exact-match of the whole turn (think channel
included), and of the answer (the response and tool calls) overall and per kind.
Exit status: 0 done, 2 a bad argument or input (one line naming it).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_k3.config import ConfigError  # noqa: E402
from megatron_k3.data.chat import decode_reply, encode_prompt  # noqa: E402
from megatron_k3.data.chat_set import EmbeddedChats  # noqa: E402
from megatron_k3.data.conversations import chat_options  # noqa: E402
from megatron_k3.data.corpus import EmbeddedCorpus  # noqa: E402
from megatron_k3.data.dataset import split_documents  # noqa: E402
from megatron_k3.data.tokenizer import load_tokenizer  # noqa: E402
from megatron_k3.training.chat_eval import answer_ids, exact_match, load_for_inference, reply_ids  # noqa: E402

SPLIT = "95,5,0"  # conf/data/chat.yaml's
KINDS = ("arithmetic", "reverse", "tool call", "image")


def tokenizer_for(model_dir: Path, tokenizer: str):
    if (model_dir / "tiktoken.model").is_file():
        return load_tokenizer(model_dir)
    if tokenizer:
        return load_tokenizer(tokenizer)
    return EmbeddedCorpus(None, 8192, progress=False).tokenizer()


def evaluate(model, tok, n: int, seed: int) -> dict:
    vision = bool(getattr(model.cfg.vision, "enabled", False))
    chats = EmbeddedChats(seed=seed, vision=vision)
    held_out = split_documents(len(chats), SPLIT)["valid"][:n]
    kinds = len(KINDS) if vision else 3
    score, rows = exact_match(model, tok, [chats.conversation(int(i)) for i in held_out],
                              load=chats.load if vision else None)
    thinking = [chat_options(chats.conversation(int(i)))["thinking"] for i in held_out]
    answers = [answer_ids(tok, ref, t) == answer_ids(tok, reply, t) for (_, ref, reply), t in zip(rows, thinking)]
    out = {"exact_match": round(score, 4), "answer_match": round(sum(answers) / max(len(answers), 1), 4),
           "conversations": len(rows)}
    for k in range(kinds):
        hits = [a for i, a in zip(held_out, answers) if i % kinds == k]
        if hits:
            out[f"answer_match_{KINDS[k].replace(' ', '_')}"] = round(sum(hits) / len(hits), 4)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--prompt", default="")
    ap.add_argument("--system", default="You are a helpful assistant.")
    ap.add_argument("--no-thinking", action="store_true")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--tokenizer", default="")
    ap.add_argument("--eval", type=int, default=0, metavar="N")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", metavar="FILE", help="--eval: also write the JSON line to FILE")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        model = load_for_inference(a.dir)
        tok = tokenizer_for(Path(a.dir), a.tokenizer)
        if a.eval:
            line = json.dumps(evaluate(model, tok, a.eval, a.seed))
            print(line)
            if a.out:
                Path(a.out).write_text(line + "\n")
            return 0
        if not a.prompt:
            raise ConfigError("--prompt", "", "give a user message, or --eval N")
        msgs = [{"role": "system", "content": a.system}, {"role": "user", "content": a.prompt}]
        prompt = encode_prompt(tok, msgs, thinking=not a.no_thinking)
        print(tok.decode(prompt))
        print(decode_reply(tok, reply_ids(model, tok, prompt, a.max_new_tokens)))
        return 0
    except (ConfigError, ValueError, OSError) as e:
        print(f"tools/chat.py: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

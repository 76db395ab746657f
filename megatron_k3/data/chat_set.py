"""The embedded chat set of data=chat (no download): conversations with checkable answers, drawn from (seed, index).

Kinds, by index: arithmetic on small numbers ("What is 17 - 8?" -> "9"), string reversal of 3 or 4 letters
("Reverse the letters of: kode" -> "edok"), a tool call with typed arguments (get_weather(city, unit, days) in K3's
tool-call form), and, for a vision-language model, a question about an embedded drawn image ("What is in this
picture?" -> its caption, the drawings of data=multimodal). Some conversations think (a short reasoning in the think
channel), most do not; every one ends with the assistant's answer, the part a held-out evaluation decodes and compares
exactly (docs/sft.md).

A source of conversations has len(), where(i), conversation(i) -> {"messages", "tools"?, "thinking"?,
"thinking_effort"?} whose image parts name a handle ("drawing:<i>" here, a path in conversations.ChatJsonl, the file
form), size(handle) and load(handle)."""

from __future__ import annotations

import json

import numpy as np

from .drawings import SyntheticDocuments, draw

__all__ = ["EmbeddedChats", "EMBEDDED_CHATS", "WEATHER_TOOL"]

EMBEDDED_CHATS = 4000  # conversations of the embedded set
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_CITIES = ("Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo", "Delhi", "Quito", "Seoul", "Perth", "Hanoi", "Dakar")
_SYSTEM = "You are a helpful assistant."

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city.",
    "parameters": {"type": "object", "required": ["city", "unit", "days"], "properties": {
        "city": {"type": "string", "description": "The city's name."},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "description": "Days ahead, 1 to 7."}}}}}


class EmbeddedChats:
    """`num` conversations drawn from (seed, index); `vision`: every fourth is a question about a drawn image."""

    def __init__(self, num: int | None = None, seed: int = 0, vision: bool = False):
        self.num = EMBEDDED_CHATS if num is None else int(num)
        self.seed, self.vision, self.name = seed, bool(vision), "embedded chat set"
        self._drawings = SyntheticDocuments(seed=seed)

    def __len__(self) -> int:
        return self.num

    def where(self, i: int) -> str:
        return f"embedded chat {i}"

    def conversation(self, i: int) -> dict:
        if not 0 <= i < self.num:
            raise IndexError(i)
        u = self._uniforms(i)
        if self.vision and i % 4 == 3:
            return self._image(u, i)
        kinds = (self._arithmetic, self._reverse, self._tool)
        return kinds[i % (4 if self.vision else 3)](u)

    @staticmethod
    def _chat(user, answer: str, u, reasoning: str = "") -> dict:
        thinking = bool(reasoning) and bool(u[11] < 0.5)
        msg = {"role": "assistant", "content": answer}
        if thinking:
            msg["reasoning_content"] = reasoning
        return {"messages": [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": user}, msg],
                "thinking": thinking}

    def _arithmetic(self, u) -> dict:
        a, b, op = int(u[0] * 20), int(u[1] * 10), "+-*"[int(u[2] * 3)]
        value = a + b if op == "+" else a - b if op == "-" else a * b
        return self._chat(f"What is {a} {op} {b}?", str(value), u, reasoning=f"{a} {op} {b} = {value}.")

    def _reverse(self, u) -> dict:
        n = 3 + int(u[0] * 2)
        word = "".join(_LETTERS[int(x * 26)] for x in u[1:1 + n])
        return self._chat(f"Reverse the letters of: {word}", word[::-1], u, reasoning=f"Backwards, {word} reads "
                          f"{' '.join(word[::-1])}.")

    def _tool(self, u) -> dict:
        city, unit = _CITIES[int(u[0] * len(_CITIES))], ("celsius", "fahrenheit")[int(u[1] * 2)]
        days = 1 + int(u[2] * 7)
        args = json.dumps({"city": city, "unit": unit, "days": days})
        call = {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": args}}]}
        user = f"What will the weather be in {city} in {days} day{'s' if days > 1 else ''}, in {unit}?"
        return {"messages": [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": user}, call],
                "tools": [WEATHER_TOOL], "thinking": False}

    def _uniforms(self, i: int):
        return np.random.default_rng([self.seed, 0xC4A7, i]).random(12)

    def _image(self, u, i: int) -> dict:
        _, what, bg = self._drawings._shape_image(u[:7])
        user = [{"type": "image_url", "image_url": {"url": f"drawing:{i}"}},
                {"type": "text", "text": "What is in this picture?"}]
        article = "an" if bg[0] in "aeiou" else "a"
        return self._chat(user, f"{what[0].upper()}{what[1:]} on {article} {bg} background.", u)

    def _drawing(self, handle: str):
        """The drawing of an image part's URL "drawing:<conversation index>"."""
        return self._drawings._shape_image(self._uniforms(int(handle.split(":", 1)[1]))[:7])[0]

    def size(self, handle) -> tuple:
        d = self._drawing(handle)
        return d.width, d.height

    def load(self, handle):
        return draw(self._drawing(handle))

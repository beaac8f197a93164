"""The agent workload of ``agent_replay.py``: deterministic texts, identical for every
configuration, and the *ideal* hit of each request.

N sessions x M turns of a coding-agent conversation:
  - every session starts with the same system prompt (project notes and a JSON tool block
    rendered as text, so no tool parser is needed), then its task. Tasks of later sessions
    repeat the first half of session 0's task and then go their own way, so they leave
    session 0's checkpoint *inside* its file (a sibling session);
  - each later turn appends the model's reply and a "tool result" of random length
    (0.5..1.5 x the mean), so prompts end anywhere, not near grid points.

The ideal of a request is what the server had already computed once: the longest prefix
of its prompt token ids that equals some earlier request's prompt + generated ids (the
KV of those tokens existed), floored to the KV block and below the whole prompt (vLLM
always computes its last token). ``cached / ideal`` is the hit rate a perfect cache would
reach; 1.0 is the target.
"""

from __future__ import annotations

import json
import pathlib
import sysconfig

import numpy as np

TOOLS = [
    (
        "read_file",
        (
            "Read a text file from the workspace and return its contents with line "
            "numbers. Large files are truncated; use offset and limit to page through them."
        ),
        {"path": "string", "offset": "integer", "limit": "integer"},
    ),
    (
        "write_file",
        (
            "Create or overwrite a file in the workspace with the given content. "
            "Parent directories are created as needed."
        ),
        {"path": "string", "content": "string"},
    ),
    (
        "apply_patch",
        (
            "Apply a unified diff to files in the workspace. Fails without changing "
            "anything if a hunk does not apply cleanly."
        ),
        {"patch": "string"},
    ),
    (
        "run_shell",
        (
            "Run a shell command in the workspace and return its exit status, "
            "standard output and standard error, truncated to the last 20000 characters."
        ),
        {"command": "string", "timeout_s": "integer"},
    ),
    (
        "grep",
        (
            "Search files under a directory for a regular expression and return matching "
            "lines with file names and line numbers."
        ),
        {"pattern": "string", "path": "string", "glob": "string"},
    ),
    (
        "list_dir",
        (
            "List the entries of a directory, with sizes and types, recursively up to "
            "the given depth."
        ),
        {"path": "string", "depth": "integer"},
    ),
    (
        "run_tests",
        (
            "Run the project's test suite or a subset of it and return the summary and "
            "the output of failing tests."
        ),
        {"selector": "string", "verbose": "boolean"},
    ),
    (
        "search_docs",
        (
            "Search the documentation index of the project's dependencies and return "
            "the best matching passages with their source."
        ),
        {"query": "string", "top_k": "integer"},
    ),
]


def corpus() -> str:
    """Python standard-library sources (the tiny tokenizer was trained on the same)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    parts = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(root.glob("*.py"))]
    return "\n".join(parts)


class Workload:
    def __init__(
        self,
        tokenizer,
        *,
        sessions: int,
        turns: int,
        system_tokens: int,
        tools_tokens: int,
        task_tokens: int,
        tool_result_tokens: int,
        seed: int = 0,
    ):
        self.tok = tokenizer
        self.text = corpus()
        rng = np.random.default_rng(seed)
        self.system = (
            "You are a careful software engineering agent working in a git "
            "repository. Think step by step, call one tool at a time, read "
            "before you write, and keep answers short.\n\n# Project notes\n"
            + self.snippet(system_tokens, rng)
        )
        self.system += "\n\n# Tools\n\n" + self.tool_block(tools_tokens, rng)
        first_task = self.snippet(task_tokens, rng)
        shared = first_task[: len(first_task) // 2]
        self.tasks = []
        for s in range(sessions):
            own = first_task if s == 0 else shared + self.snippet(task_tokens // 2, rng)
            self.tasks.append(
                "Task: the project at /work/project has a failing test. Find "
                "the cause and fix it. Context from the issue:\n" + own + f"\n[session {s}]"
            )
        self.results = [
            [None]
            + [
                f"Tool result (call {t}, {TOOLS[(s + t) % len(TOOLS)][0]}):\n"
                + self.snippet(int(tool_result_tokens * rng.uniform(0.5, 1.5)), rng)
                for t in range(1, turns)
            ]
            for s in range(sessions)
        ]

    def tokens(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))

    def snippet(self, n_tokens: int, rng) -> str:
        if n_tokens <= 0:
            return ""
        start = int(rng.integers(0, len(self.text) - 12 * n_tokens))
        ids = self.tok.encode(self.text[start : start + 12 * n_tokens], add_special_tokens=False)
        return self.tok.decode(ids[:n_tokens])

    def tool_block(self, n_tokens: int, rng) -> str:
        """OpenAI-style function definitions, one JSON object per line, padded with more
        (generated) tools until the block has about n_tokens tokens."""
        tools = [self._tool(name, desc, params) for name, desc, params in TOOLS]
        i = 0
        while self.tokens("\n".join(tools)) < n_tokens:
            i += 1
            desc = " ".join(self.snippet(40, rng).split())
            tools.append(self._tool(f"project_tool_{i}", desc, {"args": "string"}))
        return (
            "You may call one or more functions. Function signatures are within "
            "<tools></tools> XML tags:\n<tools>\n" + "\n".join(tools) + "\n</tools>\n"
            'Answer a call with a JSON object {"name": ..., "arguments": {...}}.'
        )

    @staticmethod
    def _tool(name: str, desc: str, params: dict[str, str]) -> str:
        schema = {
            "type": "object",
            "required": [next(iter(params))],
            "properties": {k: {"type": v} for k, v in params.items()},
        }
        return json.dumps(
            {
                "type": "function",
                "function": {"name": name, "description": desc, "parameters": schema},
            }
        )

    def messages(self, history: list[dict], session: int, turn: int) -> list[dict]:
        """The conversation of ``session`` at ``turn`` (1-based), after ``history``."""
        if turn == 1:
            return [
                {"role": "system", "content": self.system},
                {"role": "user", "content": self.tasks[session]},
            ]
        return history + [{"role": "user", "content": self.results[session][turn - 1]}]


class Ideal:
    """What the server has computed so far, to measure each request's ideal hit."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.computed: list[np.ndarray] = []

    def of(self, prompt: list[int]) -> int:
        ids = np.asarray(prompt, dtype=np.int64)
        best = 0
        for seq in self.computed:
            n = min(len(seq), len(ids))
            differ = np.flatnonzero(seq[:n] != ids[:n])
            best = max(best, int(differ[0]) if differ.size else n)
        best = min(best, len(ids) - 1)
        return best - best % self.block_size

    def add(self, prompt: list[int], generated: list[int]) -> None:
        """The KV a request left: its prompt and every generated token but the last."""
        self.computed.append(np.asarray(prompt + generated[:-1], dtype=np.int64))

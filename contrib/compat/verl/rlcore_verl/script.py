"""Reading a verl example script: the overrides its ``python3 -m verl.trainer.main_ppo`` line passes, with the
shell's variables expanded as bash would. Understood: comments, ``\\`` continuation lines, ``VAR=...`` and
``export VAR=...`` assignments, ``$VAR`` / ``${VAR}`` / ``${VAR:-default}`` / ``${VAR-default}``, arithmetic
``$((...))`` (+ - * / % and parentheses, integers), single and double quotes and backslash escapes. Not run:
command substitution ``$(...)`` (its value is empty, and noted), ``source``, tests and other commands (skipped).
Variables the script does not set come from ``env`` (the caller's environment), else are empty, as in bash."""
from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass, field

from rlcore.errors import ConfigError

ENTRY = "verl.trainer.main_ppo"
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass
class Script:
    overrides: list[str]                       # key=value, as main_ppo receives them
    config_name: str = "ppo_megatron_trainer"  # --config-name
    notes: list[str] = field(default_factory=list)   # what was not run, and why


def read_script(text: str, env: dict[str, str] | None = None, source: str = "script") -> Script:
    """The main_ppo overrides of a verl shell script (the first main_ppo command)."""
    shell = _Shell(dict(env or {}), source)
    for words in (c for line in _logical_lines(text) for c in shell.commands(line)):
        if ENTRY in words:
            return shell.command(words[words.index(ENTRY) + 1:])
        if words[0] == "export":
            words = words[1:]
        if words and all(ASSIGNMENT.match(w) for w in words):
            for w in words:
                name, value = w.split("=", 1)
                shell.vars[name] = value
        elif words:
            shell.notes.append(f"not run: {' '.join(words)[:80]}")
    raise ConfigError(f"{source}: no 'python3 -m {ENTRY}' command found (rlcore verl translate reads verl's "
                      f"main_ppo scripts)")


def _logical_lines(text: str) -> list[str]:
    """Lines with '\\'-newline continuations joined and comments dropped (a '#' starting a word, outside quotes)."""
    joined = re.sub(r"\\\n", " ", text)
    return [_strip_comment(line) for line in joined.splitlines()]


def _strip_comment(line: str) -> str:
    quote = ""
    for i, c in enumerate(line):
        if quote:
            if c == quote:
                quote = ""
            elif c == "\\" and quote == '"':
                continue
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


class _Shell:
    def __init__(self, env: dict[str, str], source: str):
        self.vars: dict[str, str] = {}
        self.env = env
        self.source = source
        self.notes: list[str] = []

    def lookup(self, name: str) -> str:
        if name in self.vars:
            return self.vars[name]
        if name in self.env:
            return self.env[name]
        if name not in ("@", "*"):
            self.notes.append(f"${name} is not set: empty, as in bash")
        return ""

    def command(self, args: list[str]) -> Script:
        overrides, config_name = [], "ppo_megatron_trainer"
        for arg in args:
            if arg.startswith("--config-name"):
                config_name = arg.split("=", 1)[1].removesuffix(".yaml") if "=" in arg else config_name
            elif arg.startswith("--config-path"):
                continue
            elif arg.startswith("-"):
                self.notes.append(f"not read: main_ppo argument {arg}")
            elif arg:
                overrides.append(arg)
        return Script(overrides, config_name, self.notes)

    def words(self, line: str) -> list[str]:
        return [w for command in self.commands(line) for w in command]

    def commands(self, line: str) -> list[list[str]]:
        """Split a line into commands (at ; && || |) of words with quotes removed and expansions done, as bash
        does (no globbing)."""
        commands: list[list[str]] = []
        words: list[str] = []
        current: list[str] = []
        started = False
        i, n = 0, len(line)
        while i < n:
            c = line[i]
            if c in ";&|":
                if started:
                    words.append("".join(current))
                    current, started = [], False
                if words:
                    commands.append(words)
                words = []
                i += 1
            elif c.isspace():
                if started:
                    words.append("".join(current))
                    current, started = [], False
                i += 1
            elif c == "'":
                end = line.find("'", i + 1)
                if end < 0:
                    raise ConfigError(f"{self.source}: unclosed ' in: {line.strip()[:80]}")
                current.append(line[i + 1:end])
                started, i = True, end + 1
            elif c == '"':
                i, text = self._double_quoted(line, i + 1)
                current.append(text)
                started = True
            elif c == "\\" and i + 1 < n:
                current.append(line[i + 1])
                started, i = True, i + 2
            elif c == "$":
                i, text = self._dollar(line, i)
                current.append(text)
                started = True
            else:
                current.append(c)
                started, i = True, i + 1
        if started:
            words.append("".join(current))
        return [*commands, words] if words else commands

    def _double_quoted(self, line: str, i: int) -> tuple[int, str]:
        out: list[str] = []
        while i < len(line):
            c = line[i]
            if c == '"':
                return i + 1, "".join(out)
            if c == "\\" and i + 1 < len(line) and line[i + 1] in '"\\$`':
                out.append(line[i + 1])
                i += 2
            elif c == "$":
                i, text = self._dollar(line, i)
                out.append(text)
            else:
                out.append(c)
                i += 1
        raise ConfigError(f'{self.source}: unclosed " in: {line.strip()[:80]}')

    def _dollar(self, line: str, i: int) -> tuple[int, str]:
        """An expansion starting at line[i] == '$': (index after it, its value)."""
        rest = line[i + 1:]
        if rest.startswith("(("):
            end = _matching(line, i + 1)
            return end + 1, str(self.arithmetic(line[i + 3:end - 1]))
        if rest.startswith("("):
            end = _matching(line, i + 1)
            self.notes.append(f"not run: command substitution {line[i:end + 1][:60]} (empty)")
            return end + 1, ""
        if rest.startswith("{"):
            end = _matching(line, i + 1, "{", "}")
            return end + 1, self._braced(line[i + 2:end])
        if rest[:1] in ("@", "*"):
            return i + 2, ""
        m = NAME.match(rest)
        if not m:
            return i + 1, "$"
        return i + 1 + m.end(), self.lookup(m.group())

    def _braced(self, body: str) -> str:
        m = NAME.match(body)
        if not m:
            self.notes.append(f"not expanded: ${{{body}}} (empty)")
            return ""
        name, op = m.group(), body[m.end():]
        value = self.vars.get(name, self.env.get(name))
        if op.startswith(":-") or op.startswith("-"):
            default = op[2:] if op.startswith(":-") else op[1:]
            if value is None or (op.startswith(":-") and value == ""):
                return "".join(self.words(default)) if default else ""
            return value
        if op:
            self.notes.append(f"not expanded: ${{{body}}} (the value of ${name} used)")
        return self.lookup(name)

    def arithmetic(self, expr: str) -> int:
        """bash's $((...)) on integers: variables by name (with or without $), + - * / % and parentheses."""
        text = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", r"\1", expr)
        text = NAME.sub(lambda m: str(_as_int(self.lookup(m.group()), m.group(), self.source)), text)
        try:
            return _evaluate(ast.parse(text.strip(), mode="eval").body)
        except (SyntaxError, ValueError, ZeroDivisionError) as e:
            raise ConfigError(f"{self.source}: cannot evaluate $(({expr})): {e}") from None


def _as_int(value: str, name: str, source: str) -> int:
    try:
        return int(value or 0)
    except ValueError:
        raise ConfigError(f"{source}: ${name} = {value!r} in an arithmetic expansion is not an integer") from None


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Mod: operator.mod}


def _evaluate(node: ast.expr) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv)):
            quotient = abs(left) // abs(right)                 # bash truncates toward zero
            return quotient if (left >= 0) == (right >= 0) else -quotient
        if type(node.op) in _OPS:
            return _OPS[type(node.op)](left, right)
    raise ValueError("only integers, + - * / % and parentheses")


def _matching(line: str, start: int, open_: str = "(", close: str = ")") -> int:
    """The index of the bracket closing the one at line[start]."""
    depth = 0
    for j in range(start, len(line)):
        if line[j] == open_:
            depth += 1
        elif line[j] == close:
            depth -= 1
            if depth == 0:
                return j
    raise ConfigError(f"unclosed {open_!r} in: {line.strip()[:80]}")

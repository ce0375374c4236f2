"""The command line's parser, as train.py and eval.py read their flags: `--max-steps` and `--max_steps` alike, no
abbreviations, a bad flag answered in one line that names the closest one, and the ranges a value must lie in
(checked)."""
import argparse
import difflib
import math
import sys


class Parser(argparse.ArgumentParser):
    """argparse as train.py and eval.py read their flags: `--max-steps` and `--max_steps` alike (TRL's and
    HfArgumentParser's users type hyphens), no abbreviations (`--max_step` would silently set --max_steps),
    and a bad flag answered in one line that names the closest flag, not the whole usage."""

    def __init__(self, **kw):
        super().__init__(allow_abbrev=False, **kw)

    def spelling(self, arg):
        """--max-steps -> --max_steps, --no-one-shot -> --no-one_shot, when that is a flag; else arg as given."""
        if not arg.startswith("--") or arg == "--":
            return arg
        name, eq, value = arg[2:].partition("=")
        negated = name[:3] in ("no-", "no_") and f"--no-{name[3:].replace('-', '_')}" in self._option_string_actions
        flag = f"--no-{name[3:].replace('-', '_')}" if negated else "--" + name.replace("-", "_")
        return flag + eq + value if flag in self._option_string_actions else arg

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args([self.spelling(a) for a in args], namespace)

    def error(self, message):
        """One line on stderr and exit code 2; an unknown flag gets the closest real one."""
        flags = [a for a in self._option_string_actions if a.startswith("--")]
        unknown = [w for w in message.split() if w.startswith("--")] if message.startswith("unrecognized") else []
        close = difflib.get_close_matches(unknown[0].split("=")[0], flags, n=1, cutoff=0.6) if unknown else []
        hint = f"; did you mean {close[0]}?" if close else f" (see {self.prog} --help)"
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")


# the ranges a flag's value must lie in: (test, words); a value outside is refused as the command line is parsed
POSITIVE = (lambda v: math.isfinite(v) and v > 0, "> 0")
AT_LEAST_1 = (lambda v: v >= 1, ">= 1")
BETA = (lambda v: 0 <= v < 1, "in [0, 1)")
FRACTION = (lambda v: 0 <= v <= 1, "in [0, 1]")
STEPS = (lambda v: v == -1 or v >= 1, ">= 1, or -1")


def checked(kind, check):
    """An argparse `type`: kind(text), refused in one line (argparse names the flag) outside check's range."""
    test, words = check

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}")
        if not test(value):
            raise argparse.ArgumentTypeError(f"must be {words}, got {text}")
        return value
    parse.__name__ = kind.__name__                                  # argparse's own messages name the kind
    return parse

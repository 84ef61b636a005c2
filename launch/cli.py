"""What the launchers print: rljax's own lines, third-party libraries quiet.

Every launcher calls ``setup_logging()`` first in ``main()`` (after absl's
``app.run`` has parsed the flags and installed its handler), and starts
through ``run(main)``, which reports an error as its message alone.
"""

import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from absl import app, flags
from absl import logging as absl_logging

# The directory holding rljax/, launch/ and configs/.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_COMPACT = logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S")


class _Handler(logging.StreamHandler):
  """rljax's console handler (a class of its own, so it is added once)."""


class _DropBackendProbes(logging.Filter):
  """Drops JAX's "Unable to initialize backend 'tpu'" (a probe, not a fault)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Unable to initialize backend")


def setup_logging() -> None:
  """rljax's logger at INFO with a compact format; everything else at WARNING.

  Orbax, grain and JAX log through ``absl.logging`` or standard loggers under
  the root logger, whose level absl sets from ``--verbosity``. An explicit
  ``--verbosity``/``-v`` sets every level, rljax's too (``--verbosity=1``
  shows everything); absl's ``--logger_levels`` still apply. Idempotent.
  """
  explicit = flags.FLAGS.is_parsed() and flags.FLAGS["verbosity"].present
  if not explicit:
    absl_logging.set_verbosity(absl_logging.WARNING)
    probe_logger = logging.getLogger("jax._src.xla_bridge")
    if not any(isinstance(f, _DropBackendProbes) for f in probe_logger.filters):
      probe_logger.addFilter(_DropBackendProbes())
  log = logging.getLogger("rljax")
  log.setLevel(logging.getLogger().getEffectiveLevel() if explicit
               else logging.INFO)
  log.propagate = False
  if not any(isinstance(h, _Handler) for h in log.handlers):
    handler = _Handler(sys.stderr)
    handler.setFormatter(_COMPACT)
    log.addHandler(handler)


def run(main: Callable[[list[str]], Any]) -> None:
  """``absl.app.run(main)``, reporting an exception as its message alone.

  A launcher's errors name the field, the value and what is accepted in
  their message; the traceback above it is noise to a user. Without an
  explicit ``--verbosity`` an exception prints ``error: <message>`` and
  where it was raised, and the process exits with status 1; with
  ``--verbosity`` (any level) it propagates with its full traceback.
  Usage errors, ``SystemExit`` and ``KeyboardInterrupt`` pass through.
  """

  def guarded(argv):
    try:
      return main(argv)
    except (app.UsageError, SystemExit, KeyboardInterrupt):
      raise
    except Exception as e:  # pylint: disable=broad-exception-caught
      if flags.FLAGS.is_parsed() and flags.FLAGS["verbosity"].present:
        raise
      print(error_line(e), file=sys.stderr, flush=True)
      sys.exit(1)

  app.run(guarded, flags_parser=parse_flags)


def first_line(launcher: str, default_config: str, default_workdir: str
               ) -> None:
  """Prints what is about to be built, before JAX and the config load (the
  next lines come seconds later): the launcher, the config file and the
  run directory of the command line (or their defaults)."""
  import time  # pylint: disable=import-outside-toplevel
  from rljax import __version__  # pylint: disable=import-outside-toplevel
  config = os.path.abspath(default_config)
  if not os.path.relpath(config).startswith(".."):
    config = os.path.relpath(config)
  workdir = default_workdir
  for arg in sys.argv[1:]:
    if arg.startswith("--config="):
      config = arg.split("=", 1)[1]
    elif arg.startswith("--workdir="):
      workdir = arg.split("=", 1)[1]
  if any(a in ("--help", "--helpshort", "--helpfull") for a in sys.argv):
    return
  print(f"{time.strftime('%H:%M:%S')} rljax {__version__}: {launcher} with "
        f"{config} in {workdir}; loading JAX and the config",
        file=sys.stderr, flush=True)


def define_config_file(name: str, default: str, help_string: str):
  """``config_flags.DEFINE_config_file``, which reads the command line's
  ``--config.<field>=<value>`` overrides when it is defined (as the
  launcher is imported): an override that names no field, or a value of
  the wrong type, is reported in one line (``config_error_line``) and the
  process exits with status 1; ``--verbosity`` keeps the traceback.

  A key under a dict field that the config file does not set is added
  (``--config.model.overrides.num_layers=1`` on ``:tiny``, whose
  ``model.overrides`` is empty): ml_collections' ``accept_new_attributes``,
  with every other new name refused first, in one line, as a mistyped
  field."""
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  unknown = unknown_field_line(sys.argv)
  if unknown:
    if _verbose(sys.argv):
      raise ValueError(unknown)  # with its traceback
    print(unknown, file=sys.stderr, flush=True)
    sys.exit(1)
  try:
    return config_flags.DEFINE_config_file(
        name, default, help_string, lock_config=False,
        accept_new_attributes=True)
  except Exception as e:  # pylint: disable=broad-exception-caught
    if _verbose(sys.argv):
      raise
    print(config_error_line(sys.argv, e), file=sys.stderr, flush=True)
    sys.exit(1)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a config override that names no field (or
  gives a value of the wrong type) reported in one line: the field, the
  closest accepted names, and how to list them. ``--verbosity`` on the
  command line keeps ml_collections' own traceback."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:  # absl's own flags: absl reports them
    if not _config_overrides(argv):
      print(f"FATAL Flags parsing error: {e}", file=sys.stderr, flush=True)
      sys.exit(1)
    error: BaseException = e
  except Exception as e:  # pylint: disable=broad-exception-caught
    error = e
  if _verbose(argv):
    raise error
  print(config_error_line(argv, error), file=sys.stderr, flush=True)
  sys.exit(1)


def _verbose(argv: list[str]) -> bool:
  """``--verbosity`` on the command line: errors keep their tracebacks."""
  return any(a.startswith("--verbosity") for a in argv)


def _config_overrides(argv: list[str]) -> list[tuple[str, str]]:
  """``(field, value)`` of each ``--config.<field>=<value>`` in ``argv``."""
  out = []
  for arg in argv[1:]:
    if arg.startswith("--config."):
      field, _, value = arg[len("--config."):].partition("=")
      out.append((field, value))
  return out


def config_error_line(argv: list[str], error: BaseException) -> str:
  """One line for a config override that failed to parse: an unknown
  field with the closest names (``rljax/train/schema.py`` lists every
  field), else the override and ml_collections' message."""
  unknown = unknown_field_line(argv)
  if unknown:
    return unknown
  message = " ".join(str(error).split())  # ml_collections' message, one line
  overrides = " ".join(f"--config.{f}={v}" for f, v in _config_overrides(argv))
  return f"error: {overrides}: {message[:300]}"


def unknown_field_line(argv: list[str]) -> str | None:
  """``error: --config.<field>=<value>: config has no field ...`` with the
  closest names, for the first override of ``argv`` that names no field
  of the schema and no key under a dict field; None if there is none."""
  import difflib  # pylint: disable=import-outside-toplevel
  from rljax.train import schema  # pylint: disable=import-outside-toplevel
  fields = schema.fields()
  # A dict field takes any key below it (task.kwargs.max_digits).
  open_fields = tuple(f + "." for f, spec in fields.items()
                      if isinstance(spec.default, dict))
  for field, value in _config_overrides(argv):
    if field in fields or field.startswith(open_fields):
      continue
    close = difflib.get_close_matches(field, list(fields), n=3, cutoff=0.6)
    if not close:  # a mistyped section: the fields of the closest one
      section = field.partition(".")[2]
      close = difflib.get_close_matches(
          section, [f.partition(".")[2] for f in fields], n=3, cutoff=0.6)
      close = [f for f in fields if f.partition(".")[2] in close][:3]
    hint = (f"; did you mean {', '.join('config.' + c for c in close)}?"
            if close else "")
    return (f"error: --config.{field}={value}: config has no field "
            f"{field!r}{hint} (every field: rljax/train/schema.py)")
  return None


def error_line(error: BaseException) -> str:
  """``error: <type>: <message>`` and where it was raised, for ``run``."""
  frames = traceback.extract_tb(error.__traceback__)
  where = ""
  if frames:
    frame = frames[-1]
    name = os.path.abspath(frame.filename)
    if name.startswith(_ROOT + os.sep):  # rljax's own: from its root
      name = os.path.relpath(name, _ROOT)
    where = f" [{name}:{frame.lineno}]"
  message = str(error) or "(no message)"
  return (f"error: {type(error).__name__}: {message}{where}\n"
          "(--verbosity=1 shows the traceback)")


_PHASES = (("sft", "SFT"), ("sample", "sampling"), ("reward", "rewards"),
           ("advantage", "advantages"), ("train", "training"),
           ("evaluation", "evaluation"), ("checkpoint", "checkpoints"))


def run_summary(summary: dict) -> str:
  """The end of ``launch.train``: held-out figures, time, throughput, files.

  Args:
    summary: what ``rljax.train.run`` returns.
  """
  before, after = summary["before"], summary["after"]
  finished = summary.get("already_finished", False)
  lines = ["run summary (the run had already finished: nothing was trained "
           "or written now):" if finished else "run summary:"]
  for key, label in (("eval/accuracy", "held-out accuracy (T="
                      f"{summary['sampling_temperature']:g} sampling)"),
                     ("eval/greedy_accuracy", "held-out accuracy (greedy)")):
    b, a = before.get(key), after.get(key)
    if b is not None and a is not None:
      lines.append(f"  {label}: before RL {100 * b:.1f}%, after RL "
                   f"{100 * a:.1f}% ({100 * (a - b):+.1f} points)")
  if not finished:
    seconds = summary["seconds_by_phase"]
    rest = summary["seconds"] - sum(seconds.values())
    parts = [f"{label} {seconds[k]:.0f}s" for k, label in _PHASES]
    lines.append(f"  wall clock {summary['seconds']:.0f}s: {', '.join(parts)}, "
                 f"set-up and other {max(rest, 0):.0f}s")
    first = summary.get("first_step")
    if first is not None:
      lines.append(f"  first RL step (compiles the sampler and the update): "
                   f"sampling {first['seconds']['sample']:.0f}s, training "
                   f"{first['seconds']['train']:.0f}s")
    rate = summary["tokens_per_s"]
    which = " after the first step" if summary.get("steps", 0) > 1 else ""
    lines.append(f"  tokens/s{which}: sampling {rate['sample']:,.0f}, "
                 f"training {rate['train']:,.0f}")
  lines.append(f"  files in {summary['workdir']}:")
  for path, what in ((summary["metrics"], "metrics, one row per step"),
                     (summary["tensorboard"],
                      f"tensorboard --logdir={summary['tensorboard']}"),
                     (summary["plot"], "reward and accuracy curves"),
                     (summary["checkpoints"],
                      "checkpoints (launch.sample, launch.evaluate, "
                      "launch.export)")):
    if os.path.exists(path):
      name = os.path.relpath(path, summary["workdir"])
      name += "/" if os.path.isdir(path) else ""
      lines.append(f"    {name:<14} {what}")
  return "\n".join(lines)

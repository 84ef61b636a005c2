"""Launchers: ``python -m launch.<name>``.

Started that way on Linux, a launcher re-executes itself once, first thing,
with glibc's malloc on transparent huge pages (``huge_pages``): XLA:CPU
allocates each step's large buffers afresh, and on 4 KiB pages touching
them costs a page fault per page (573k per step of the 4.5M-parameter
padding-free step, 1.4k on huge pages: 1.36-1.47x faster,
``python -m launch.bench_train_step --huge_pages_ab``).
``RLJAX_HUGE_PAGES=0`` keeps the process as started.
"""

import os
import sys

HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"


def huge_pages_env(environ) -> dict | None:
  """``environ`` with glibc's malloc on transparent huge pages, or None
  where nothing is to change: not Linux with glibc, the kernel's huge pages
  off, the tunable already set, or ``RLJAX_HUGE_PAGES=0``."""
  if environ.get("RLJAX_HUGE_PAGES", "1") == "0" or sys.platform != "linux":
    return None
  try:
    if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
      return None
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
      if "[never]" in f.read():
        return None
  except (OSError, ValueError):
    return None
  tunables = environ.get("GLIBC_TUNABLES", "")
  if "glibc.malloc.hugetlb" in tunables:
    return None
  return {**environ, "GLIBC_TUNABLES": ":".join(
      t for t in (tunables, HUGE_PAGES_TUNABLE) if t)}


def _reexec_with_huge_pages() -> None:
  """Re-executes ``python -m launch.<name> ...`` as started, once, with
  ``huge_pages_env`` (glibc reads its tunables only when a process starts);
  an in-process import (tests, notebooks) changes nothing."""
  argv = getattr(sys, "orig_argv", [])
  if len(argv) < 3 or argv[1] != "-m" or not argv[2].startswith("launch."):
    return
  env = huge_pages_env(os.environ)
  if env is not None:
    os.execve(sys.executable, argv, env)


_reexec_with_huge_pages()

"""``trainer-ext checkpoint verify|seal DIR``: check a checkpoint folder against its marker, file by file, or commit
a folder changed on purpose (re-sharded weights) with a fresh marker so it can be resumed.

Exit codes: 0 verified (or sealed), 1 the folder does not verify (each problem printed), 2 bad input (one
``error:`` line from the CLI's main). The checks (:mod:`trainer_ext.checkpointing.audit`) import torch; parsing and
``--help`` do not.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence

from trainer_ext.errors import ConfigError

EXIT_OK, EXIT_NOT_VERIFIED = 0, 1
_USAGE = "trainer-ext checkpoint {verify,seal} DIR"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one `error:` line and exit 2 through the CLI, like every other mistake
        raise ConfigError(f"{message} (usage: {_USAGE})")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="trainer-ext checkpoint",
        description=(
            "Check a checkpoint folder against its COMPLETE marker (verify), or check its files as they are now and "
            "write a fresh marker (seal) after changing them on purpose, e.g. re-sharding the weights."
        ),
    )
    actions = parser.add_subparsers(dest="action", metavar="{verify,seal}", parser_class=_Parser)
    actions.required = True
    verify = actions.add_parser(
        "verify",
        help="list what differs from the marker, file by file; exit 0 verified, 1 not",
        description=(
            "List every problem of a checkpoint folder: its marker missing or damaged, each file missing, resized, "
            "changed or added since the marker, symbolic links, files that would not load. Exit 0 when it "
            "verifies, 1 when it does not, 2 when DIR is not a checkpoint folder."
        ),
    )
    seal = actions.add_parser(
        "seal",
        help="check the files as they are now and write a fresh marker, so the checkpoint can be resumed",
        description=(
            "Check the files of a checkpoint folder as they are now (a Trainer checkpoint: trainer_state.json with "
            "its global_step and the model's weights, an index consistent with its shards; an Accelerator state: "
            "random_states_0.pkl; every file loadable safely, none a symbolic link) and write a fresh COMPLETE "
            "marker atomically. The run's facts (world size, strategy, batch sizes) are kept from the previous "
            "marker when it is whole. Refused (exit 2, nothing written) when the folder is not such a checkpoint."
        ),
    )
    for sub in (verify, seal):
        sub.add_argument("dir", metavar="DIR", help="a checkpoint folder (checkpoint-N, or a save_state folder)")
    return parser


def _describe(marker: dict, kind: str | None) -> str:
    """``trainer checkpoint, step 4, 2 processes`` from a marker's facts."""
    parts = [f"{kind or marker.get('kind') or 'a'} checkpoint"]
    if marker.get("step") is not None:
        parts.append(f"step {marker['step']}")
    count = marker.get("world_size")
    parts.append(f"{count} process{'es' if count != 1 else ''}")
    return ", ".join(parts)


def _verify(directory: str) -> int:
    from trainer_ext.checkpointing.audit import audit

    found = audit(directory)
    if found.ok:
        files = len(found.marker["files"])
        print(f"{directory} verifies: {files} files as committed ({_describe(found.marker, found.kind)})")
        return EXIT_OK
    print(f"{directory} does not verify ({len(found.problems)} problem{'s' if len(found.problems) > 1 else ''}):")
    for problem in found.problems:
        print(f"  {problem.text}")
    print(
        "If these files were changed on purpose, check them and commit them with a fresh marker: "
        f"trainer-ext checkpoint seal {shlex.quote(directory)}"
    )
    return EXIT_NOT_VERIFIED


def _seal(directory: str) -> int:
    from trainer_ext.checkpointing.audit import seal_checkpoint

    sealed = seal_checkpoint(directory)
    what = _describe(sealed.marker, None)
    if sealed.already:
        print(f"{directory} already verifies ({what}): marker left as it is")
        return EXIT_OK
    files = len(sealed.marker["files"])
    facts = "the run's facts kept from the previous marker"
    if not sealed.facts_kept:
        facts = "no valid previous marker: the process count read from the per-rank files"
        if sealed.marker.get("kind") == "trainer":  # no batch sizes to match another process count against
            facts += ", and the Trainer resumes it on that number of processes only"
    print(f"sealed {directory}: {files} files committed ({what}; {facts})")
    return EXIT_OK


def run_checkpoint(argv: Sequence[str]) -> int:
    """Run ``verify`` or ``seal``; bad input raises ConfigError (one ``error:`` line, exit 2, from the CLI's main)."""
    args = _parser().parse_args(list(argv))
    return _verify(args.dir) if args.action == "verify" else _seal(args.dir)

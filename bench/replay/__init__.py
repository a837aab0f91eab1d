"""Replayed rigs for the scale bench: one sandbox rig recorded, served as N rigs in-process.

- `record`: runs the real pyinfra or rigbook CLI over pyinfra's own SSH connector against one
  sandbox rig and writes every remote command (its stdout, stderr and exit code) and every file
  put or get, in order, per host.
- `recording`: the recorded converges of one tool as one JSON file, and the identity swap that
  makes the recorded rig another one (its name, address and GPU UUIDs, in commands and answers).
- `connector`: `@replay/NAME`, a pyinfra connector that answers from a recording; a command it
  has not recorded fails that rig, naming the command. pyinfra finds it through its own entry
  points (`pyinfra.connectors`) only with `dist/` on sys.path (`PYTHONPATH`): never installed,
  never used against a real rig.
- `inventory`: N replayed rigs for rigbook's deploys and `rigbook status`.
- `scale`: `python -m bench --replay`: records, then replays fleets of each size.
"""

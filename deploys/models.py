"""Pull models into the rigs' Hugging Face caches, and nothing else.

    pyinfra inventory/rigs.py deploys/models.py
    pyinfra inventory/rigs.py deploys/models.py --data models_only=Qwen/Qwen3-0.6B --limit rig1

On every rig (all at once) it makes the HF cache (models_cache) hold each pinned snapshot of
`models` completely, or only the one models_only names, and prints one line per pull: what was
pulled, how many GiB, in how many seconds. A snapshot already complete (checked locally against
rigbook's manifest) costs no network call. A pull that would not fit on the cache's filesystem is
refused with the numbers, a partial one fails its rig with the missing files; the other rigs go
on. Without models_only it also reports cached repos that models does not list (and removes
them with models_prune: true). An HF token comes from models_token_file or the HF_TOKEN
environment variable of this machine. docs/models.md has the details.
"""

from rigbook.jobs import pull_models

pull_models()

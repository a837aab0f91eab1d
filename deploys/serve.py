"""Switch a rig (or a group) to another serving recipe, and know it came up healthy.

    pyinfra inventory/rigs.py deploys/serve.py --data recipe=dual-3090-draft --limit rig-dual3090
    pyinfra inventory/rigs.py deploys/serve.py --data recipe=llamacpp-single --limit single_5090

On each rig: the recipe is checked against the rig (card class and count, NVLink, platform,
venv, pinned models), then, when the engine must change, the preflights run (GPUs there, model
and draft complete in the cache, venv current for the driver, no other engine, weights + KV fit
free VRAM and host RAM). A failed preflight changes nothing: the old engine keeps serving. Then
the old engine is stopped gracefully, the new one started, and the health check waits for
/v1/models and one completion; a failed start prints the unit's journal and leaves the rig
serving nothing (the failure is reported; never two engines on one GPU). Without --data recipe
the rig's own recipe is converged. docs/runbooks/switch-recipe.md walks through it.
"""

from rigbook.jobs import serve

serve()

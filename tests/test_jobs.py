"""Both forms of a job run the same code: each deploys/*.py is its docstring and one call of
its function in rigbook.jobs, and every job has its deploy file."""

from __future__ import annotations

import ast

from rigbook.jobs import JOBS
from tests.conftest import ROOT


def test_each_deploy_file_is_one_call_of_its_job():
    assert sorted(JOBS.values()) == sorted(
        str(path.relative_to(ROOT)) for path in (ROOT / "deploys").glob("*.py"))
    for job, path in JOBS.items():
        body = ast.parse((ROOT / path).read_text()).body
        assert isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant), path
        assert [ast.unparse(node) for node in body[1:]] == [
            f"from rigbook.jobs import {job.__name__}", f"{job.__name__}()"], path


def test_the_help_names_the_command_of_every_job():
    from rigbook.cli import jobs_epilog

    text = jobs_epilog()
    for job, path in JOBS.items():
        assert f"pyinfra INVENTORY rigbook.jobs.{job.__name__}" in text and path in text

"""The role pages' generated parts (rigbook/docs.py): every role page of the registry is checked
by `rigbook docs --check`, a stale or unmarked page fails it, and every host-data key belongs
to exactly one role or shared group (rigbook/registry.py), so each settings table is whole."""

from __future__ import annotations

import shutil

import pytest

from rigbook import cli
from rigbook.core.errors import RigbookError
from rigbook.core.spec import Rig
from rigbook.docs import generated_docs, operations, role_section, stale_docs, write_docs
from rigbook.registry import ROLES, SHARED, keys_of
from rigbook.roles import driver, tuning
from tests.conftest import ROOT

DOCS = ROOT / "docs"
PAGES = sorted({role.page for role in ROLES})


@pytest.fixture
def docs(tmp_path):
    """A copy of the checkout's docs folder, to alter."""
    shutil.copytree(DOCS, tmp_path / "docs")
    return tmp_path / "docs"


def test_every_host_data_key_is_tagged_with_one_role_or_shared_group():
    owners = {key: [] for key in Rig.model_fields}
    for role in ROLES:
        for key in keys_of(role.keys):
            owners[key].append(role.name)
    for group, entries in SHARED.items():
        for key in keys_of(entries):
            owners[key].append(group)
    assert {key: names for key, names in owners.items() if len(names) != 1} == {}
    # an entry that names no key is a typo, not a tag
    for entries in [role.keys for role in ROLES] + list(SHARED.values()):
        assert all(keys_of((entry,)) for entry in entries), entries


def test_the_check_covers_every_role_page_of_the_registry():
    generated = generated_docs(DOCS)
    assert {DOCS / page for page in PAGES} <= set(generated)
    for role in ROLES:
        assert role_section(role) in generated[DOCS / role.page], role.name
    assert stale_docs(DOCS) == []


@pytest.mark.parametrize("page", PAGES)
def test_a_role_page_without_its_markers_fails_the_check(docs, page):
    path = docs / page
    path.write_text(path.read_text().replace("<!-- generated: ", "<!-- was generated: "))
    problems = stale_docs(docs)
    assert problems and str(path) in problems[0], problems
    if page != "footprint.md":  # generated whole: `rigbook docs` writes it back
        assert "lacks its generated part" in problems[0]
        with pytest.raises(RigbookError, match="lacks its generated part"):
            write_docs(docs)


def test_a_stale_generated_part_fails_the_check_and_the_prose_around_it_stays(docs, capsys):
    path = docs / "tuning.md"
    edited = path.read_text().replace("| `tuning.sysctl_live(values, conf)` | Apply",
                                      "| `tuning.sysctl_live(values, conf)` | Set")
    edited = edited.replace("## Why these settings", "## Why these settings, edited by hand")
    path.write_text(edited)
    assert stale_docs(docs) == [f"{path} differs from what the code generates; run "
                                "`rigbook docs`"]
    assert cli.main(["docs", "--check", "--dir", str(docs)]) == 1
    assert cli.main(["docs", "--dir", str(docs)]) == 0
    assert stale_docs(docs) == []
    text = path.read_text()
    assert "| `tuning.sysctl_live(values, conf)` | Apply" in text
    assert "## Why these settings, edited by hand" in text
    capsys.readouterr()


def test_a_missing_role_page_fails_the_check(docs):
    (docs / "guards.md").unlink()
    assert stale_docs(docs)[0].startswith(f"{docs / 'guards.md'} lacks its generated part")


def test_a_docs_folder_without_role_pages_has_the_whole_docs_only(tmp_path):
    written = write_docs(tmp_path)  # what `rigbook init fleet` makes
    assert sorted(path.name for path in written) == ["footprint.md", "host-data.md",
                                                      "recipes.md"]
    assert stale_docs(tmp_path) == []


def test_the_operation_table_comes_from_the_docstrings():
    section = role_section(next(role for role in ROLES if role.name == "tuning"))
    assert ("| `tuning.host_tuning(rig)` | `@deploy` \"Host tuning\": Converge inotify limits, "
            "/dev/shm and leftovers (see the module docstring). |  |") in section
    assert ("| `tuning.sysctl_live(values, conf)` | Apply sysctl values to the running kernel "
            "where they differ from it. | `values`: key -> value, exactly as in `conf`; `conf`: "
            "the sysctl.d file that holds them (written by an earlier step) |") in section
    assert "| `sysctl_extra` | `dict[str, Union[int, str]]` | `{}` |" in section
    # a `+ arg:` line continued on the next, indented one
    row = next(line for line in role_section(ROLES[0]).splitlines()
               if line.startswith("| `driver.install_driver("))
    assert ("`unpinned`: packages installed without the glob (Ubuntu's prebuilt signed modules, "
            "whose version is the kernel's; what they depend on pins them to the driver's) |"
            ) in row
    # operations imported into a module are its source's, not its own
    assert tuning.sysctl_live in operations(tuning) and driver.install_driver in operations(driver)
    assert not any(op.__module__ != "rigbook.roles.tuning" for op in operations(tuning))

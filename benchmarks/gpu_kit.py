"""The GPU kit: one folder holding everything `make gpu-check` and `make test-cuda` import beyond
what a GPU machine brings (torch, safetensors, tqdm and jinja2, with what they load), so that the
first run on a machine without network cannot miss a package. transformers, tokenizers and
huggingface-hub (STACK) are carried too, at the lock's versions with what they require: a machine's
may be missing, or a 4.x whose model silently differs from ours (another RoPE spelling).

`build` (`make gpu-kit`, in .venv; needs PyPI). In: the CUDA tests' folders (and the modules left
out of them), requirements.lock, the packaged model's tokenizer. Out, in --out (git-ignored):
  wheels/                   the wheels, at the lock's versions, for CPython 3.11-3.13 on manylinux
                            x86_64: a pure-Python wheel once, a binary one per Python
  requirements-cpXY.txt     what to install on that Python (`name==version`, one a line)
  tokenizer/                the packaged tokenizer's files (the served requests are tokenized with
                            them; the check's weights are random)
  kit.json, MANIFEST        the same, for `install` and for people: per Python the pins, which
                            ones the lock lacks, and the modules `install` checks
Which packages: a child Python imports the base (BASE, and STACK with the transformers classes
the runs use), notes the modules loaded, then imports the server (`cachesmith.cli`, every
`cachesmith.server` module), the check (`benchmarks.gpu_check` and its modules) and collects the CUDA
tests (`pytest --collect-only -m cuda`); the distributions of the modules loaded after the base,
STACK, and what they require (markers evaluated per Python, never into BASE), are the kit; what
only STACK requires is listed apart (`stack_only`). A requirement the lock lacks (one that only some
Pythons need, e.g. exceptiongroup below 3.11) is taken at its newest allowed version and marked
`unlocked` in the MANIFEST.

`install` (`make gpu-check` / `make test-cuda`, in the GPU machine's Python; standard library and
pip only: `packaging` is pip's copy where the machine has none). In: the kit, a target folder and
pyproject.toml. Out: the kit's packages for this Python that the machine lacks, or has at another
version, installed into the target from the kit alone (`--no-index`). STACK is decided apart
(`stack_choice`): the machine's transformers where it is within pyproject's range, else the kit's
with the kit's tokenizers, huggingface-hub and what only they require; one line per STACK package
says which was used. Then every module in kit.json imported with the target on the path. Exit
status 1, naming what is missing, when the kit has no wheels for this Python, lacks a wheel, or a
module does not import; `--need-tokenizer` also requires the kit's tokenizer files.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASE = ("torch", "safetensors", "tqdm", "jinja2")  # what the GPU machine brings
STACK = ("transformers", "tokenizers", "huggingface-hub")  # carried: the machine's is used only within range
STACK_MODULES = ("transformers", "tokenizers", "huggingface_hub")  # `install` checks that they import
PROJECT = "cachesmith"  # travels as the checkout, not as a wheel
# the lock's versions need 3.11 or later (fastapi, starlette, uvicorn, numpy; pyproject's
# requires-python says so too): a 3.10 kit would lack them (`--pythons 3.10` names each)
PYTHONS = ("3.11", "3.12", "3.13")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
TOKENIZER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "vocab.json", "merges.txt")
CHECKED = ("cachesmith.server", "cachesmith.cli")  # imported last by `install`: the whole server

# The child that names the modules: the base and STACK first (what they load is the machine's, or
# STACK's closure), then ours.
PROBE = r"""
import importlib, json, pkgutil, sys
out, tests, ignore = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
for name in ("torch", "transformers", "safetensors.torch", "tqdm", "jinja2"):
    importlib.import_module(name)
import transformers
for attr in ("AutoConfig", "AutoModelForCausalLM", "AutoTokenizer", "LlamaConfig", "LlamaForCausalLM",
             "PreTrainedTokenizerFast", "GenerationConfig"):
    getattr(transformers, attr)
base = set(sys.modules)
import cachesmith.cli, cachesmith.server
for info in pkgutil.walk_packages(cachesmith.server.__path__, "cachesmith.server."):
    importlib.import_module(info.name)
import benchmarks.gpu_check, benchmarks.common.serve_leg
import pytest
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-p", "pytest_timeout", "-m", "cuda",
                    *tests, *("--ignore=" + i for i in ignore)])
json.dump({"collected": int(code), "base": sorted(base), "ours": sorted(set(sys.modules) - base)}, open(out, "w"))
"""


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# -- build ---------------------------------------------------------------------------------------
def probe(tests: list[str], ignore: list[str]) -> dict:
    """The modules loaded by the base, and those loaded after it by the server, check and tests."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "modules.json"
        env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",  # only what the tests import
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        proc = subprocess.run([sys.executable, "-c", PROBE, str(out), " ".join(tests), " ".join(ignore)],
                              cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            raise SystemExit(f"gpu-kit: importing the server, the check and the CUDA tests failed:\n"
                             f"{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
        found = json.loads(out.read_text())
    if found["collected"] not in (0, 5):  # 5: no test selected on a machine without a GPU
        raise SystemExit(f"gpu-kit: collecting {' '.join(tests)} failed (pytest exit {found['collected']})")
    return found


def distributions_of(modules: list[str]) -> dict[str, list[str]]:
    """Installed distribution -> the top-level modules of `modules` it provides (stdlib and this
    repository's own modules have none)."""
    from importlib.metadata import packages_distributions

    owners = packages_distributions()
    out: dict[str, list[str]] = {}
    for top in sorted({m.split(".")[0] for m in modules} - set(sys.stdlib_module_names)):
        for dist in owners.get(top, ()):
            out.setdefault(canon(dist), []).append(top)
    return out


def marker_env(python: str) -> dict[str, str]:
    return {"python_version": python, "python_full_version": python + ".0", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def closure(roots: set[str], python: str) -> dict[str, str | None]:
    """`roots` and what they require on `python` (not into BASE): name -> the requirement's
    specifier where the package is not installed here (its own requirements are then unknown)."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement

    found: dict[str, str | None] = {}
    stack = [(name, None) for name in sorted(roots)]
    while stack:
        name, spec = stack.pop()
        if name in found or name in BASE:
            continue
        try:
            requires = distribution(name).requires or []
            found[name] = None
        except PackageNotFoundError:
            found[name] = spec or ""
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(marker_env(python)):
                stack.append((canon(req.name), str(req.specifier)))
    return found


def lock_pins(lock: Path) -> dict[str, str]:
    pins = {}
    for line in lock.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9_.-]*)==([^\s\\;]+)", line)
        if m:
            pins[canon(m.group(1))] = m.group(2)
    return pins


def pip_download(python: str, requirements: list[str], dest: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", python, "--implementation", "cp", "--disable-pip-version-check",
           *(f"--platform={p}" for p in PLATFORMS), "-d", str(dest), *requirements]
    return subprocess.run(cmd, capture_output=True, text=True)


def wheel_version(path: Path) -> str:
    return path.name.split("-")[1]


def fetch(python: str, wanted: dict[str, str | None], pins: dict[str, str], wheels: Path) -> tuple[dict, list]:
    """The wheels of `wanted` for `python` into `wheels` (a file already there is not fetched
    again: a pure-Python wheel is shared). Out: name -> version, and what could not be fetched."""
    locked = [f"{n}=={pins[n]}" for n in sorted(wanted) if n in pins]
    versions, failed = {n: pins[n] for n in wanted if n in pins}, []
    if locked and pip_download(python, locked, wheels).returncode != 0:
        for req in locked:  # one at a time, to name the one that failed
            proc = pip_download(python, [req], wheels)
            if proc.returncode != 0:
                why = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "pip failed"
                failed.append(f"{req} ({why})")
                versions.pop(req.split("==")[0])
    for name in sorted(n for n in wanted if n not in pins):  # needed here only: newest allowed
        with tempfile.TemporaryDirectory() as tmp:
            proc = pip_download(python, [f"{name}{wanted[name] or ''}"], Path(tmp))
            got = sorted(Path(tmp).glob("*.whl"))
            if proc.returncode != 0 or not got:
                failed.append(f"{name}{wanted[name] or ''} (not in the lock; {proc.stderr.strip()[-200:]})")
                continue
            versions[name] = wheel_version(got[0])
            if not (wheels / got[0].name).exists():
                shutil.move(str(got[0]), wheels / got[0].name)
    return versions, failed


def copy_tokenizer(dest: Path) -> list[str]:
    from cachesmith.model import DEFAULT_MODEL
    from cachesmith.model.assets import is_complete, models_root

    source = models_root() / DEFAULT_MODEL
    if not is_complete(source):
        raise SystemExit(f"gpu-kit: the packaged model is not fetched: `cachesmith models fetch {DEFAULT_MODEL}`")
    dest.mkdir(parents=True, exist_ok=True)
    names = [n for n in TOKENIZER_FILES if (source / n).is_file()]
    for name in names:
        shutil.copy(source / name, dest / name)
    return names


def manifest_text(kit: dict, wheels: Path) -> str:
    lines = ["The GPU kit (python -m benchmarks.gpu_kit build; carry this folder with the checkout).",
             f"Beyond: {', '.join(BASE)} (and what they load).",
             f"Carried, used where the machine's is missing or outside pyproject.toml's range: {', '.join(STACK)}.",
             ""]
    for python, pins in kit["pythons"].items():
        unlocked = [n for n in pins if n in kit["unlocked"]]
        lines.append(f"CPython {python}: {len(pins)} packages" + (f" ({', '.join(unlocked)} not in the lock)"
                                                                  if unlocked else ""))
        lines += [f"  {name}=={version}" for name, version in sorted(pins.items())]
    files = sorted(wheels.glob("*.whl"))
    lines += ["", f"wheels/: {len(files)} files, {sum(f.stat().st_size for f in files) / 1e6:.1f} MB"]
    lines += [f"  {f.name}" for f in files]
    lines += ["", f"tokenizer/: {', '.join(kit['tokenizer'])}", f"checked imports: {', '.join(kit['modules'])}"]
    return "\n".join(lines) + "\n"


def build(args) -> int:
    out, wheels = args.out, args.out / "wheels"
    found = probe(args.tests, args.ignore)
    base_dists = set(distributions_of(found["base"]))
    ours = {d: tops for d, tops in distributions_of(found["ours"]).items()
            if d not in base_dists and d not in BASE and d != PROJECT}
    pins = lock_pins(REPO / "requirements.lock")
    wheels.mkdir(parents=True, exist_ok=True)
    kit = {"base": list(BASE), "stack": list(STACK), "pythons": {}, "stack_only": {}, "unlocked": [],
           "failed": {}, "modules": []}
    for python in args.pythons:
        needed, stack = closure(set(ours), python), closure(set(STACK), python)
        versions, failed = fetch(python, {**stack, **needed}, pins, wheels)
        kit["pythons"][python] = versions
        # installed only with the kit's transformers: a machine's brings its own
        kit["stack_only"][python] = sorted(set(stack) - set(needed) - set(STACK))
        kit["unlocked"] = sorted(set(kit["unlocked"]) | {n for n in versions if n not in pins})
        if failed:
            kit["failed"][python] = failed
        (out / f"requirements-cp{python.replace('.', '')}.txt").write_text(
            "".join(f"{n}=={v}\n" for n, v in sorted(versions.items())))
    tops = sorted({t for tops in ours.values() for t in tops if not t.startswith("_")})
    kit["modules"] = list(dict.fromkeys([*tops, *STACK_MODULES, *CHECKED]))
    kit["tokenizer"] = copy_tokenizer(out / "tokenizer")
    (out / "kit.json").write_text(json.dumps(kit, indent=1))
    (out / "MANIFEST").write_text(manifest_text(kit, wheels))
    print(f"gpu-kit: {len(list(wheels.glob('*.whl')))} wheels for CPython {', '.join(args.pythons)} and the "
          f"tokenizer in {out}/ (MANIFEST)")
    for python, failed in kit["failed"].items():
        print(f"gpu-kit: no wheel for CPython {python}: {'; '.join(failed)}", file=sys.stderr)
    return 1 if kit["failed"] else 0


# -- install (the GPU machine: standard library and pip only) ------------------------------------
def packaging_classes() -> tuple[type, type, type]:
    """`packaging`'s Requirement, SpecifierSet and Version: the machine's, else pip's own copy (a
    bare machine has no `packaging`; pip, which installs the kit, always carries one)."""
    try:
        from packaging.requirements import Requirement
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version
    except ImportError:
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.specifiers import SpecifierSet
        from pip._vendor.packaging.version import Version
    return Requirement, SpecifierSet, Version


def project_ranges(pyproject: Path) -> dict[str, str]:
    """pyproject.toml's ranges for STACK: name -> specifier (a name it does not list: no range)."""
    import tomllib

    requirement = packaging_classes()[0]
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return {canon(r.name): str(r.specifier) for r in map(requirement, deps) if canon(r.name) in STACK}


def requirements_of(name: str) -> list[str]:
    """The installed distribution's Requires-Dist lines ([] where it is not installed)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        return distribution(name).requires or []
    except PackageNotFoundError:
        return []


def asked_of(requires: list[str], name: str) -> str:
    """What Requires-Dist lines ask of `name` outside extras, as one specifier ('' for nothing)."""
    requirement = packaging_classes()[0]
    specs = [str(r.specifier) for r in map(requirement, requires)
             if canon(r.name) == name and (r.marker is None or r.marker.evaluate({"extra": ""}))]
    return ",".join(s for s in specs if s)


def outside(version: str | None, spec: str) -> str | None:
    """Why a machine's `version` does not do for `spec` (None: it does). Pre-releases count as in
    range (a machine's dev build of an allowed version is that version)."""
    if version is None:
        return "the machine has none"
    _, specifiers, parse = packaging_classes()
    try:
        if specifiers(spec).contains(parse(version), prereleases=True):
            return None
    except ValueError:  # an unparsable version: not one we can vouch for
        pass
    return f"the machine's {version} is outside {spec or 'any version'}"


def stack_choice(machine: dict[str, str], ranges: dict[str, str], requires: list[str]) -> dict[str, tuple[str, str]]:
    """Where each STACK package comes from: name -> ("machine" or "kit", why the kit's).

    In: the machine's versions (name -> version; absent: not installed), pyproject's ranges
    (`project_ranges`) and the machine's transformers' Requires-Dist lines. The machine's
    transformers where installed within pyproject's range; then tokenizers and huggingface-hub each
    the machine's where installed within pyproject's range and what that transformers asks of it,
    else the kit's. Without the machine's transformers all three are the kit's: the lock's set,
    resolved together (the kit's transformers may need newer ones than a machine's)."""
    why = outside(machine.get("transformers"), ranges.get("transformers", ""))
    if why is not None:
        return {name: ("kit", why if name == "transformers" else "with the kit's transformers") for name in STACK}
    out = {"transformers": ("machine", "")}
    for name in STACK[1:]:
        spec = ",".join(filter(None, [ranges.get(name, ""), asked_of(requires, name)]))
        why = outside(machine.get(name), spec)
        out[name] = ("machine", "") if why is None else ("kit", why)
    return out


def installed() -> dict[str, str]:
    from importlib.metadata import distributions

    return {canon(d.metadata["Name"]): d.version for d in distributions() if d.metadata["Name"]}


def import_failures(modules: list[str], site: Path) -> list[str]:
    """Each module that does not import with `site` and the checkout first on the path, and why."""
    code = ("import importlib, json, sys\nbad = []\nfor m in sys.argv[1:]:\n    try:\n"
            "        importlib.import_module(m)\n    except Exception as exc:\n"
            "        bad.append(f'{m} ({type(exc).__name__}: {exc})')\nprint(json.dumps(bad))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), str(site),
                                                                      os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", code, *modules], cwd=REPO, env=env, capture_output=True, text=True)
    return json.loads(proc.stdout) if proc.returncode == 0 else [f"the import check itself ({proc.stderr[-500:]})"]


def missing_wheels(wheels: Path, todo: list[str]) -> list[str]:
    """The `name==version` pins of `todo` with no wheel in `wheels` that this Python can install."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    have = set()
    for f in wheels.glob("*.whl"):
        name, version, python_tag, abi = f.name.split("-")[:4]
        if python_tag.startswith("py3") or tag in python_tag.split(".") or abi == "abi3":
            have.add(f"{canon(name)}=={version}")
    return [req for req in todo if req not in have]


def fail(message: str) -> int:
    print(f"gpu-kit: {message}", file=sys.stderr)
    return 1


def site_versions(site: Path) -> dict[str, str]:
    """What an earlier install put in `site` (it goes first on the path): name -> version."""
    from importlib.metadata import distributions

    if not site.is_dir():
        return {}
    return {canon(d.metadata["Name"]): d.version for d in distributions(path=[str(site)]) if d.metadata["Name"]}


def wanted_here(pins: dict[str, str], stack_only: list[str], choice: dict[str, tuple[str, str]]) -> dict[str, str]:
    """The kit's pins this machine takes from the kit, before what it has is compared: every pin but
    STACK's, the STACK packages chosen from the kit, and what only STACK requires where the kit's
    transformers is used (a machine's transformers comes with its own)."""
    out = {n: v for n, v in pins.items() if n not in STACK and n not in stack_only}
    out.update({n: pins[n] for n in STACK if choice[n][0] == "kit"})
    if choice["transformers"][0] == "kit":
        out.update({n: pins[n] for n in stack_only})
    return out


def stack_lines(choice: dict[str, tuple[str, str]], have: dict[str, str], pins: dict[str, str],
                site_has: dict[str, str]) -> list[str]:
    """One line per STACK package: its version and whose it is (an earlier install's copy in the
    site shadows a machine's: it is the one imported)."""
    lines = []
    for name in STACK:
        source, why = choice[name]
        if source == "kit":
            lines.append(f"{name} {pins[name]}: from the kit ({why})")
        elif name in site_has:
            lines.append(f"{name} {site_has[name]}: from the kit, installed by an earlier run (first on the "
                         f"path; remove the site folder to use the machine's {have[name]})")
        else:
            lines.append(f"{name} {have[name]}: the machine's")
    return lines


def pip_install(kit: Path, site: Path, todo: list[str]) -> subprocess.CompletedProcess:
    """`todo` (`name==version`) into `site` from the kit's wheels alone: no index, no dependencies."""
    return subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                           "--no-compile", "--disable-pip-version-check", "--upgrade", "--find-links",
                           str(kit / "wheels"), "--target", str(site), *todo], capture_output=True, text=True)


def install(args) -> int:
    kit_file, python = args.kit / "kit.json", f"{sys.version_info.major}.{sys.version_info.minor}"
    if not kit_file.is_file():
        return fail(f"no kit at {args.kit}/: run `make gpu-kit` where PyPI is reachable and carry {args.kit}/")
    kit = json.loads(kit_file.read_text())
    if python not in kit["pythons"]:
        return fail(f"the kit has no wheels for Python {python} (it has {', '.join(kit['pythons'])})")
    if "stack_only" not in kit or any(n not in kit["pythons"][python] for n in STACK):
        return fail(f"the kit at {args.kit}/ carries no {', '.join(STACK)}: run `make gpu-kit` again")
    if args.need_tokenizer and not (args.kit / "tokenizer" / "tokenizer.json").is_file():
        return fail(f"no tokenizer files in {args.kit}/tokenizer/: run `make gpu-kit` again")
    pins, have, site_has = kit["pythons"][python], installed(), site_versions(args.site)
    choice = stack_choice(have, project_ranges(REPO / "pyproject.toml"), requirements_of("transformers"))
    wanted = wanted_here(pins, kit["stack_only"][python], choice)
    todo = [f"{n}=={v}" for n, v in sorted(wanted.items()) if have.get(n) != v and site_has.get(n) != v]
    for line in stack_lines(choice, have, pins, site_has):
        print(f"gpu-kit: {line}")
    for name, version in sorted(wanted.items()):
        if name in have and have[name] != version and name not in STACK:
            print(f"gpu-kit: {name} {have[name]} is installed; the kit's {version} goes first on the path")
    absent = missing_wheels(args.kit / "wheels", todo)
    if absent:
        return fail(f"{args.kit}/wheels has no wheel for Python {python} of: {', '.join(absent)} "
                    f"(run `make gpu-kit` again)")
    if todo:
        proc = pip_install(args.kit, args.site, todo)
        if proc.returncode != 0:
            return fail(f"installing from {args.kit}/wheels failed:\n{proc.stderr[-2000:]}")
    bad = import_failures(kit["modules"], args.site)
    if bad:
        return fail("these do not import on this machine:\n  " + "\n  ".join(bad))
    print(f"gpu-kit: {len(todo)} packages installed into {args.site}; {len(kit['modules'])} modules import")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="gather the kit (needs PyPI)")
    b.add_argument("--out", type=Path, default=REPO / "gpu-kit")
    b.add_argument("--tests", nargs="+", default=["tests/kvstore", "tests/model", "tests/recompute"])
    b.add_argument("--ignore", nargs="*", default=[], help="test modules `make test-cuda` leaves out")
    b.add_argument("--pythons", nargs="+", default=list(PYTHONS))
    i = sub.add_parser("install", help="install the kit's packages this machine lacks, then check the imports")
    i.add_argument("--kit", type=Path, default=REPO / "gpu-kit")
    i.add_argument("--site", type=Path, required=True)
    i.add_argument("--need-tokenizer", action="store_true")
    args = ap.parse_args()
    return build(args) if args.command == "build" else install(args)


if __name__ == "__main__":
    sys.exit(main())

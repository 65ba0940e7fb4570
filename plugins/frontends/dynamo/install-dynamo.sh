#!/usr/bin/env bash
# Install NVIDIA Dynamo 1.6.1 for omniloop-dynamo, from PyPI only.
#
#   plugins/frontends/dynamo/install-dynamo.sh [--python PY] [--venv DIR | --into-base]
#
# Why a script: `pip install ai-dynamo` fails where only PyPI is reachable: ai-dynamo 1.6.1 requires
# aisimulate==0.13.0, a "wheel stub" sdist whose build downloads the real wheel from another index.
# So this installs ai-dynamo==1.6.1 and ai-dynamo-runtime==1.6.1 with --no-deps, then their real
# dependencies (taken from the two wheels' metadata, minus aisimulate, which the worker and the
# frontend never import).
#
# Where: ai-dynamo-runtime pins pydantic<=2.13.5, older than what an omniloop env may hold. By
# default the script keeps the omniloop env (PY, default: .venv/bin/python, else python3) untouched
# and makes an *overlay* venv at DIR (default: <PY's env>/dynamo-overlay): a venv that sees PY's
# site-packages (torch, omniloop and every installed plugin) through a .pth file and holds only
# ai-dynamo, its dependencies that PY lacks, and the pydantic it needs, which shadows PY's. Run the
# worker and the frontend with DIR/bin/python. --into-base installs into PY's env itself instead
# (pydantic is downgraded there if needed).
#
# Prints the overlay's python path as its last line. Idempotent: a second run only checks.
set -euo pipefail

DYNAMO_VERSION=1.6.1
# The real dependencies of ai-dynamo 1.6.1 + ai-dynamo-runtime 1.6.1 (METADATA Requires-Dist), minus aisimulate.
DEPS=(
  "aiohttp>=3.14.3,<4.0"
  "certifi>=2026.10.19"
  "kubernetes>=32.0.1,<33.0.0"
  "msgspec>=0.19.0"
  "prometheus-client>=0.23.1,<1.0"
  "pyzmq>=26.0.0"
  "redis>=6.2.0,<9.0.0"
  "tqdm>=4.0.0"
  "transformers>=4.56.0"
  "typing-extensions>=4.10.0"
  "zstandard>=0.23.0,<1.0"
  "pydantic>=2.10.6,<=2.13.5"
  "uvloop>=0.21.0"
)

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
PY="${OMNILOOP_PYTHON:-}"
VENV="${OMNILOOP_DYNAMO_VENV:-}"
INTO_BASE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --python) PY="$2"; shift 2 ;;
    --venv) VENV="$2"; shift 2 ;;
    --into-base) INTO_BASE=1; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "install-dynamo.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ -z "$PY" ]; then
  if [ -x "$repo/.venv/bin/python" ]; then PY="$repo/.venv/bin/python"; else PY="$(command -v python3)"; fi
fi
PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"
"$PY" -c 'import sys; assert sys.version_info >= (3, 10), "ai-dynamo needs Python >= 3.10"'

start=$(date +%s)
if [ "$INTO_BASE" = 1 ]; then
  TARGET_PY="$PY"
else
  base_prefix="$("$PY" -c 'import sys; print(sys.prefix)')"
  VENV="${VENV:-$base_prefix/dynamo-overlay}"
  if [ ! -x "$VENV/bin/python" ]; then
    echo "==> creating the overlay venv $VENV over $PY" >&2
    "$PY" -m venv "$VENV"
  fi
  TARGET_PY="$VENV/bin/python"
  site="$("$TARGET_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  # the omniloop env's site-packages come *after* the overlay's own, .pth files included (editables)
  "$PY" - "$site/_omniloop_base.pth" <<'EOF'
import sys, sysconfig
paths = sysconfig.get_paths()
dirs = [paths["purelib"]] + ([paths["platlib"]] if paths["platlib"] != paths["purelib"] else [])
with open(sys.argv[1], "w") as f:
    f.write("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs) + "\n")
EOF
fi

if "$TARGET_PY" -c "import importlib.metadata as m, sys; sys.exit(0 if m.version('ai-dynamo') == '$DYNAMO_VERSION' and m.version('ai-dynamo-runtime') == '$DYNAMO_VERSION' else 1)" 2>/dev/null \
   && "$TARGET_PY" -c 'import dynamo.llm, dynamo.runtime, omniloop_dynamo' 2>/dev/null; then
  echo "==> ai-dynamo $DYNAMO_VERSION already installed for $TARGET_PY" >&2
else
  echo "==> installing ai-dynamo==$DYNAMO_VERSION ai-dynamo-runtime==$DYNAMO_VERSION (--no-deps) and their dependencies" >&2
  "$TARGET_PY" -m pip install -q --disable-pip-version-check --no-deps \
    "ai-dynamo==$DYNAMO_VERSION" "ai-dynamo-runtime==$DYNAMO_VERSION"
  "$TARGET_PY" -m pip install -q --disable-pip-version-check "${DEPS[@]}"
fi

"$TARGET_PY" - <<'EOF' >&2
import importlib.metadata as m
import dynamo.llm, dynamo.runtime  # noqa: F401
from dynamo.common.protocols import video_protocol, image_protocol  # noqa: F401
import omniloop, omniloop_dynamo  # noqa: F401
print(f"==> ok: ai-dynamo {m.version('ai-dynamo')}, pydantic {m.version('pydantic')}, omniloop {m.version('omniloop')}")
EOF
echo "==> done in $(( $(date +%s) - start ))s; run the worker and the frontend with:" >&2
echo "$TARGET_PY"

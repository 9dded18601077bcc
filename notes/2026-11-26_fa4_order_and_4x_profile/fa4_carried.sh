#!/usr/bin/env bash
# FlashAttention-4 for a GPU machine that cannot reach the package index (the device machines here). Run from the
# repository root, as F=notes/2026-11-26_fa4_order_and_4x_profile/fa4_carried.sh:
#   $F pack WHEELS      here: unpack every wheel in the folder WHEELS (flash-attn-4 and its dependencies, from
#                       `pip download`), pack the files as one tar.xz and cut it in two halves, .fa4a/part and
#                       .fa4b/part at the repository root (ignored by git), each small enough to be carried
#   $F add DIR          there: keep DIR/part in $FA4_PARTS; once both halves are there, unpack them into $FA4_SITE
#                       (defaults below)
#   eval "$($F env)"    there: the PYTHONPATH that imports flash_attn.cute from $FA4_SITE
# `pip install --target` would not run nvidia-cutlass-dsl's .pth file, so `env` adds its dsl_packages folder by hand.
set -euo pipefail
site=${FA4_SITE:-/tmp/fa4_site}      # where the packages are unpacked
parts=${FA4_PARTS:-/tmp/fa4_parts}   # where the first half waits for the second
case "${1:-}" in
  pack)
    if [ ! -d "${2:-}" ]; then
      echo "error: pack needs the folder of wheels (pip download flash-attn-4 and its dependencies into it)" >&2
      exit 2
    fi
    wheels=$(cd "$2" && pwd)
    cd "$(dirname "$0")/../.."   # the repository root (this file is in notes/<folder>/)
    tmp=$(mktemp -d)
    for w in "$wheels"/*.whl; do unzip -q -o "$w" -d "$tmp/site"; done
    (cd "$tmp/site" && tar cf - . | xz -T0 -6 > "$tmp/fa4.tar.xz")
    mkdir -p .fa4a .fa4b
    split -n 2 -d "$tmp/fa4.tar.xz" "$tmp/half."
    mv "$tmp/half.00" .fa4a/part
    mv "$tmp/half.01" .fa4b/part
    rm -rf "$tmp"
    ls -l .fa4a/part .fa4b/part ;;
  add)
    if [ ! -f "${2:-}/part" ]; then
      echo "error: add needs .fa4a or .fa4b, a folder holding a half named part (made by pack)" >&2
      exit 2
    fi
    mkdir -p "$parts"
    cp "$2/part" "$parts/$(basename "$2")"
    if [ -e "$parts/.fa4a" ] && [ -e "$parts/.fa4b" ]; then
      rm -rf "$site" && mkdir -p "$site"
      cat "$parts/.fa4a" "$parts/.fa4b" | xz -d | tar xf - -C "$site"
      echo "fa4_carried: unpacked into $site"
    else
      echo "fa4_carried: kept $2's half; the other half comes with the next call"
    fi ;;
  env)
    echo "export PYTHONPATH=$site:$site/nvidia_cutlass_dsl/dsl_packages\${PYTHONPATH:+:\$PYTHONPATH}" ;;
  *)
    echo "usage: notes/2026-11-26_fa4_order_and_4x_profile/fa4_carried.sh pack WHEELS | add DIR | env" >&2
    exit 2 ;;
esac

#!/usr/bin/env bash
# Trees of HEAD with one piece of record 84 taken out, for `bench/run.sh ab TREE` (the cost of that piece).
#   .v_noxsa:  no layer removes its output's projection on its own value (XSA off everywhere)
#   .v_nosign: the bigram row is not multiplied by its +-1 sign row
# Run from the repository root; the trees are untracked folders, so the device tool carries them.
set -euo pipefail
for v in noxsa nosign; do
  rm -rf ".v_$v"; mkdir ".v_$v"; git archive HEAD | tar -x -C ".v_$v"; rm -rf ".v_$v/notes" ".v_$v/records"
done
sed -i 's/xsa=kind == "N", /xsa=False, /' .v_noxsa/train_gpt.py
grep -q 'xsa=False, ' .v_noxsa/train_gpt.py
python3 - <<'PY'
import re, pathlib
p = pathlib.Path(".v_nosign/train_gpt.py"); s = p.read_text()
old = "\n                  * self.bigram_signs[bigram_sign_index(inputs, hp.bigram_sign_rows)])"
assert s.count(old) == 1, "the sign multiply moved: update make_variants.sh"
p.write_text(s.replace(old, ")"))
PY

#!/usr/bin/env bash
# Issue 10, items 4 and 5, on a real full file system: a small tmpfs in a private mount
# namespace. A checkpoint is saved, the disk is filled so that model.safetensors still
# fits but optimizer.safetensors does not, and then:
#   - `attn train --resume` fails with a clear message, non-zero, and leaves the old
#     checkpoint byte for byte, with no temporary file;
#   - `attn plot` onto an existing PNG fails and leaves the PNG as it was;
#   - once space is freed, --resume continues from the old step.
# Exits 77 (ctest: skipped) where a tmpfs cannot be mounted (no root, no user namespaces).
#   bash tests/checkpoint_full_disk_test.sh path/to/attn
set -uo pipefail
attn="$1"
if [ "${ATTN_IN_NAMESPACE:-}" != "1" ]; then
  flags="-m"
  [ "$(id -u)" = 0 ] || flags="-rm"
  if ! unshare $flags true 2>/dev/null; then
    echo "SKIPPED: cannot create a mount namespace here (unshare $flags failed)"
    exit 77
  fi
  ATTN_IN_NAMESPACE=1 exec unshare $flags bash "$0" "$@"
fi
mnt="$(mktemp -d)"
if ! mount -t tmpfs -o size=4m attn-full-disk "$mnt" 2>/dev/null; then
  echo "SKIPPED: cannot mount a tmpfs here"
  exit 77
fi
fail() { echo "FAILED: $*"; exit 1; }
ck="$mnt/ck"
"$attn" train --task reverse --steps 20 --out "$ck" > "$mnt/log" 2>&1 || { cat "$mnt/log"; fail "first training"; }
"$attn" plot --ckpt "$ck" --out "$mnt/map" "abc" > /dev/null || fail "first plot"
model_bytes=$(stat -c %s "$ck/model.safetensors")
opt_bytes=$(stat -c %s "$ck/optimizer.safetensors")
before="$(mktemp -d)"; cp "$ck"/* "$mnt/map.png" "$before/"
# Leave room for the new model.safetensors but not for optimizer.safetensors.
avail=$(df --output=avail -B1 "$mnt" | tail -1)
keep=$(( model_bytes + opt_bytes / 4 ))
head -c $(( avail - keep )) /dev/zero > "$mnt/filler" 2>/dev/null
echo "tmpfs: model $model_bytes bytes, optimizer $opt_bytes bytes, $(df --output=avail -B1 "$mnt" | tail -1) bytes free"

out="$("$attn" train --resume --steps 40 --out "$ck" 2>&1)"; rc=$?
echo "$out" | tail -3
[ $rc -ne 0 ] || fail "train --resume on a full disk exited 0"
echo "$out" | grep -q "checkpoint not saved: cannot write .*No space left on device; the checkpoint in .* is unchanged" \
  || fail "no clear message"
ls "$ck" | grep -q '\.tmp' && fail "temporary files left: $(ls "$ck")"
for f in "$before"/*; do
  name="$(basename "$f")"
  target="$ck/$name"; [ "$name" = map.png ] && target="$mnt/map.png"
  cmp -s "$f" "$target" || fail "$name changed"
done

head -c $(( 1 << 30 )) /dev/zero > "$mnt/filler2" 2>/dev/null  # now the disk is full
out="$("$attn" plot --ckpt "$ck" --out "$mnt/map" "a longer text to draw" 2>&1)"; rc=$?
echo "$out" | grep "error"
[ $rc -ne 0 ] || fail "plot on a full disk exited 0"
cmp -s "$before/map.png" "$mnt/map.png" || fail "map.png was changed by a failed plot"
ls "$mnt" | grep -q '\.tmp' && fail "plot left a temporary file"

rm "$mnt/filler" "$mnt/filler2"
out="$("$attn" train --resume --steps 40 --out "$ck" 2>&1)" || { echo "$out"; fail "resume after freeing space"; }
echo "$out" | grep -q "resuming .* at step 20" || fail "did not resume from step 20"
rm -rf "$before"
umount "$mnt"
echo "PASSED: full disk leaves the checkpoint and the map whole"

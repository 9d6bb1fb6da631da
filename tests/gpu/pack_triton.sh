#!/usr/bin/env bash
# Pack a triton wheel for the lent H200 machines, whose calls carry at most 64 MiB: the wheel
# (~200 MB) becomes .tcarry/a (first call) and .tcarry/b (second call, with the other wheels).
#   bash tests/gpu/pack_triton.sh path/to/triton-3.7.1-...whl
# Call 1 (carry .tcarry/a):      mkdir -p ~/tc && cp .tcarry/a/* ~/tc/
# Call 2 (carry .tcarry/b .whl): cp .tcarry/b/* ~/tc/ && bash tests/gpu/pack_triton.sh --unpack
# then run tests/gpu/run_all.sh (it installs .whl/ into .site, where triton already is).
set -euo pipefail
cd "$(dirname "$0")/../.."
if [[ "${1:-}" == "--unpack" ]]; then  # on the device: rebuild .site/triton from ~/tc
    mkdir -p .site
    tar xzf ~/tc/rest.tgz -C .site
    cat ~/tc/libtriton.xz.* | xz -dc -T8 > .site/triton/_C/libtriton.so
    chmod +x .site/triton/_C/libtriton.so
    exit 0
fi
wheel=$(realpath "$1")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && unzip -q "$wheel")
# Not needed on Hopper: the Blackwell ptxas and the static profiler libraries.
rm -f "$work"/triton/backends/nvidia/bin/ptxas-blackwell "$work"/triton/backends/nvidia/lib/cupti/*static.a
xz -9 -T0 -c "$work/triton/_C/libtriton.so" > "$work/libtriton.xz"
rm "$work/triton/_C/libtriton.so"
mkdir -p .tcarry/a .tcarry/b
grep -qx "/.tcarry/" .git/info/exclude || echo "/.tcarry/" >> .git/info/exclude
(cd "$work" && tar czf rest.tgz triton triton-*.dist-info && split -b 62914560 -d libtriton.xz libtriton.xz.)
mv "$work"/libtriton.xz.00 .tcarry/a/
mv "$work"/libtriton.xz.0[1-9] "$work"/rest.tgz .tcarry/b/
du -sh .tcarry/a .tcarry/b

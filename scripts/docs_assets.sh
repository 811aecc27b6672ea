#!/usr/bin/env bash
# Put the docs site's third-party scripts into docs/assets/vendor/ (git-ignored), so the site
# renders offline: Material for MkDocs loads Mermaid from a CDN unless the page already has it
# (mkdocs.yml lists this copy in extra_javascript). Idempotent: a copy with the pinned checksum
# is kept; anything else is fetched again. scripts/bootstrap.sh runs it.
#   - mermaid.min.js: the npm package's own bundle (MIT), taken with `npm pack` (npm checks the
#     tarball's registry integrity), one file extracted, its sha256 checked against the pin
set -euo pipefail
cd "$(dirname "$0")/.."
VENDOR=docs/assets/vendor
MERMAID_VERSION=11.17.2
MERMAID_SHA256=581ed7d74bd9048d0e3a91363927d72ef22942d7722546b27f7cc29e35390eb8

have() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]; }

if ! have "$VENDOR/mermaid.min.js" "$MERMAID_SHA256"; then
  if ! command -v npm >/dev/null 2>&1; then
    echo "[docs-assets] installing npm (apt-get)"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq npm >/dev/null
  fi
  echo "[docs-assets] mermaid $MERMAID_VERSION -> $VENDOR/mermaid.min.js"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && npm pack --silent "mermaid@$MERMAID_VERSION" >/dev/null)
  tar -xzf "$tmp/mermaid-$MERMAID_VERSION.tgz" -C "$tmp" package/dist/mermaid.min.js package/LICENSE
  have "$tmp/package/dist/mermaid.min.js" "$MERMAID_SHA256" \
    || { echo "[docs-assets] mermaid.min.js of mermaid@$MERMAID_VERSION does not match its pinned sha256"; exit 1; }
  mkdir -p "$VENDOR"
  cp "$tmp/package/LICENSE" "$VENDOR/mermaid.LICENSE"
  cp "$tmp/package/dist/mermaid.min.js" "$VENDOR/mermaid.min.js"
fi

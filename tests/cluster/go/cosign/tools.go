//go:build tools

// Pins cosign, which signs Hearth's images and chart and verifies them (build/push, the e2e
// registry suite), in this module, so that `go mod tidy` keeps its dependencies.
package tools

import _ "github.com/sigstore/cosign/v2/cmd/cosign"

//go:build tools

// Pins runc, the real node's OCI runtime, in this module, so that `go mod tidy` keeps its
// dependencies.
package tools

import _ "github.com/opencontainers/runc"

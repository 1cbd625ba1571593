//go:build tools

// Pins actionlint, which .ci/run runs on .github/workflows/, in this module, so that
// `go mod tidy` keeps its dependencies.
package tools

import _ "github.com/rhysd/actionlint/cmd/actionlint"

//go:build tools

// Pins kube-router's command in this module, so that `go mod tidy` keeps its dependencies.
package tools

import _ "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router"

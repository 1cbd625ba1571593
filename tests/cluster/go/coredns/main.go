// CoreDNS with the plugins a cluster DNS needs, built the way CoreDNS documents for a custom
// build: set dnsserver.Directives (in the order of CoreDNS's own plugin.cfg) and import those
// plugins. Leaving out the cloud and storage plugins of the default build keeps the dependency
// graph small, and its k8s.io modules are the cluster's (v0.35.5), so Go's build cache is shared
// with the Kubernetes binaries.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/loop"
	_ "github.com/coredns/coredns/plugin/metrics"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"
)

// The subset of CoreDNS v1.14's core/dnsserver/zdirectives.go order that this build includes.
var directives = []string{
	"reload",
	"ready",
	"health",
	"prometheus",
	"errors",
	"log",
	"loadbalance",
	"cache",
	"kubernetes",
	"loop",
	"forward",
}

func init() {
	dnsserver.Directives = directives
}

func main() {
	coremain.Run()
}

// Command etcd is etcd's own main, wrapped so that it builds from the Go module proxy:
// etcd's root module (go.etcd.io/etcd/v3) uses local replace directives and cannot.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}

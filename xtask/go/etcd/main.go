// Command etcd is etcd's own server main (etcdmain.Main), built from its
// published module so the lab's control plane needs no downloaded binary.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}

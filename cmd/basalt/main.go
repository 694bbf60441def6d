// Command basalt is the one binary of Basalt: every server role and every
// client tool is a subcommand. This file only wires flags to packages.
package main

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"
)

func main() {
	root := &cobra.Command{
		Use:           "basalt",
		Short:         "Basalt: a strongly consistent distributed object store and file system",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(devCmd(), metaCmd(), datanodeCmd())
	admin := adminCmd()
	admin.AddCommand(adminMetaCmd()) // admin_meta.go
	root.AddCommand(shCmd(), admin, benchCmd())
	root.AddCommand(s3Cmd(), webhdfsCmd())
	if err := root.Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "basalt:", err)
		os.Exit(1)
	}
}

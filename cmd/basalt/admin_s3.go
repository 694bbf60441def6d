package main

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// adminS3Cmd manages the S3 access keys the namespace manager keeps for
// the gateways.
func adminS3Cmd(f *connFlags) *cobra.Command {
	root := &cobra.Command{Use: "s3", Short: "S3 access keys (for basalt s3 gateways)",
		Long: `Manage the S3 access keys the namespace manager keeps for the gateways.
These calls need the cluster service token: --service-token-file (a meta
node's DATA_DIR/service-token), or $` + envServiceToken + ` / $` + envServiceTokenFile + `.`}
	var id, owner, secret, tokenFile string
	var admin bool
	root.PersistentFlags().StringVar(&tokenFile, "service-token-file", "", "file holding the cluster service token (default $"+envServiceTokenFile+", or the token in $"+envServiceToken+")")
	// connect makes a client that presents the service token.
	connect := func() (*client.Client, error) {
		tok, err := readServiceToken(tokenFile)
		if err != nil {
			return nil, err
		}
		return f.client(func(c *client.Config) { c.ServiceToken = tok })
	}
	create := &cobra.Command{
		Use:   "create-key",
		Short: "Create an access key and print its secret",
		Example: `  basalt admin s3 create-key --owner alice
  basalt admin s3 create-key --access-key AKIAEXAMPLE --secret "$SECRET"   # import an existing key`,
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 0, "none"); err != nil {
				return err
			}
			c, err := connect()
			if err != nil {
				return err
			}
			defer c.Close()
			s, err := c.Namespace().CreateS3Secret(cmd.Context(), &metapb.CreateS3SecretRequest{AccessKeyId: id, Owner: owner, SecretAccessKey: secret, Admin: admin})
			if err != nil {
				return client.FromRPC("create s3 key", err)
			}
			return printKey(f, s)
		}),
	}
	create.Flags().StringVar(&id, "access-key", "", "access key ID (default: generated)")
	create.Flags().StringVar(&owner, "owner", "", "the user the key belongs to: its buckets are theirs (default: the access key ID)")
	create.Flags().BoolVar(&admin, "admin", false, "the key may act on every user's buckets")
	create.Flags().StringVar(&secret, "secret", "", "secret to import (default: generated)")
	get := &cobra.Command{
		Use: "get-key ACCESS_KEY_ID", Short: "Print an access key and its secret",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 1, "ACCESS_KEY_ID"); err != nil {
				return err
			}
			c, err := connect()
			if err != nil {
				return err
			}
			defer c.Close()
			s, err := c.Namespace().GetS3Secret(cmd.Context(), &metapb.GetS3SecretRequest{AccessKeyId: args[0]})
			if err != nil {
				return client.FromRPC("get s3 key", err)
			}
			return printKey(f, s)
		}),
	}
	del := &cobra.Command{
		Use: "delete-key ACCESS_KEY_ID", Short: "Delete an access key (gateways stop accepting it within their cache TTL)",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 1, "ACCESS_KEY_ID"); err != nil {
				return err
			}
			c, err := connect()
			if err != nil {
				return err
			}
			defer c.Close()
			_, err = c.Namespace().DeleteS3Secret(cmd.Context(), &metapb.DeleteS3SecretRequest{AccessKeyId: args[0]})
			return client.FromRPC("delete s3 key", err)
		}),
	}
	root.AddCommand(create, get, del)
	return root
}

func printKey(f *connFlags, s *metapb.S3Secret) error {
	if f.json {
		return printJSON(os.Stdout, map[string]any{"access_key_id": s.AccessKeyId, "secret_access_key": s.SecretAccessKey, "owner": s.Owner, "admin": s.Admin})
	}
	fmt.Printf("aws_access_key_id     = %s\naws_secret_access_key = %s\n", s.AccessKeyId, s.SecretAccessKey)
	if s.Owner != "" {
		fmt.Printf("owner                 = %s\n", s.Owner)
	}
	if s.Admin {
		fmt.Printf("admin                 = true\n")
	}
	return nil
}

// btrfs-ublk-snapshotter: a containerd proxy snapshotter that serves images pushed by
// `btrfs-ublk-image push --image` lazily through ublkd, and every other image through
// containerd's own overlayfs snapshotter (docs/containerd.md).
//
//	btrfs-ublk-snapshotter serve  --address /run/btrfs-ublk-snapshotter.sock --root /var/lib/btrfs-ublk-snapshotter
//	btrfs-ublk-snapshotter pull   --address /run/containerd/containerd.sock REGISTRY/REPO:TAG
//	btrfs-ublk-snapshotter status --root /var/lib/btrfs-ublk-snapshotter
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"github.com/containerd/containerd/v2/contrib/snapshotservice"
	"github.com/containerd/log"
	"google.golang.org/grpc"
)

const (
	defaultAddress = "/run/btrfs-ublk-snapshotter/snapshotter.sock"
	defaultRoot    = "/var/lib/btrfs-ublk-snapshotter"
	defaultName    = "btrfs-ublk"
)

const usage = `usage: btrfs-ublk-snapshotter COMMAND [OPTIONS]

A containerd snapshotter for btrfs-ublk-image bundles (docs/containerd.md).

commands:
  serve    serve the snapshot API on a unix socket (containerd proxy_plugins)
  pull     pull an image into containerd, unpacking through a snapshotter with layer labels
  status   which images are served lazily and which layers were downloaded
  podman-store  mount an image's bundle into a podman additional layer store (docs/containerd.md)

Run 'btrfs-ublk-snapshotter COMMAND -h' for a command's options.
`

func main() {
	if len(os.Args) < 2 || os.Args[1] == "-h" || os.Args[1] == "--help" || os.Args[1] == "help" {
		fmt.Fprint(os.Stderr, usage)
		if len(os.Args) < 2 {
			os.Exit(2)
		}
		return
	}
	var err error
	switch os.Args[1] {
	case "serve":
		err = serveCommand(os.Args[2:])
	case "pull":
		err = pullCommand(os.Args[2:])
	case "status":
		err = statusCommand(os.Args[2:])
	case "podman-store":
		err = podmanStoreCommand(os.Args[2:])
	default:
		fmt.Fprintf(os.Stderr, "btrfs-ublk-snapshotter: unknown command %q\n\n%s", os.Args[1], usage)
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "btrfs-ublk-snapshotter %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}

// policyFlags: the signature policy every bundle mount is checked against
// (docs/signatures.md), passed to `ublkd mount`.
type policyFlags struct{ policy, registriesD *string }

func addPolicyFlags(fs *flag.FlagSet) policyFlags {
	return policyFlags{
		policy:      fs.String("policy", "", "signature policy FILE every ublkd mount is checked against (containers-policy.json; default: ublkd's, /etc/containers/policy.json when it exists)"),
		registriesD: fs.String("registries-d", "", "containers-registries.d DIR naming where signatures are (default: ublkd's, /etc/containers/registries.d)"),
	}
}

// mountArgs checks the files exist now, so a typo fails at start rather than every pull.
func (p policyFlags) mountArgs() ([]string, error) {
	var out []string
	for _, f := range []struct{ name, value string }{{"policy", *p.policy}, {"registries-d", *p.registriesD}} {
		if f.value == "" {
			continue
		}
		abs, err := filepath.Abs(f.value)
		if err == nil {
			_, err = os.Stat(abs)
		}
		if err != nil {
			return nil, fmt.Errorf("--%s %s: %w", f.name, f.value, err)
		}
		out = append(out, "--"+f.name+"="+abs)
	}
	return out, nil
}

// repeated is a flag that may be given several times.
type repeated []string

func (r *repeated) String() string     { return strings.Join(*r, " ") }
func (r *repeated) Set(v string) error { *r = append(*r, v); return nil }

func serveCommand(args []string) error {
	fs := flag.NewFlagSet("serve", flag.ExitOnError)
	address := fs.String("address", defaultAddress, "unix socket to serve the snapshot API on")
	root := fs.String("root", defaultRoot, "where snapshots, their metadata and status.json live")
	ublkd := fs.String("ublkd", "ublkd", "the ublkd binary that mounts bundles")
	var ublkdArgs repeated
	fs.Var(&ublkdArgs, "ublkd-arg", "an option for every `ublkd` call, before the verb (repeatable), e.g. --ublkd-arg=--cache-dir=/var/cache/ublkd")
	var mountArgs repeated
	fs.Var(&mountArgs, "mount-arg", "an option for `ublkd mount` (repeatable), e.g. --mount-arg=--frontend=fuse")
	level := fs.String("log-level", "info", "debug, info, warn or error")
	policy := addPolicyFlags(fs)
	_ = fs.Parse(args)
	if fs.NArg() != 0 {
		return fmt.Errorf("unexpected arguments: %v", fs.Args())
	}
	extra, err := policy.mountArgs()
	if err != nil {
		return err
	}
	mountArgs = append(mountArgs, extra...)
	if err := log.SetLevel(*level); err != nil {
		return err
	}
	ctx := log.WithLogger(context.Background(), log.L)

	sn, err := newSnapshotter(*root, ublkdArgv{bin: *ublkd, global: ublkdArgs, mount: mountArgs})
	if err != nil {
		return err
	}
	defer sn.Close()
	if err := sn.restore(ctx); err != nil {
		log.G(ctx).WithError(err).Error("some bundle snapshots could not be mounted again; they are retried on use")
	}

	if err := os.MkdirAll(filepath.Dir(*address), 0o711); err != nil {
		return err
	}
	if err := os.Remove(*address); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	l, err := net.Listen("unix", *address)
	if err != nil {
		return err
	}
	server := grpc.NewServer()
	snapshotsapi.RegisterSnapshotsServer(server, snapshotservice.FromSnapshotter(sn))

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		s := <-sig
		log.G(ctx).WithField("signal", s).Info("stopping (bundle mounts stay for the running containers)")
		server.Stop()
	}()
	log.G(ctx).WithField("address", *address).WithField("root", *root).Info("serving")
	return server.Serve(l)
}

func pullCommand(args []string) error {
	fs := flag.NewFlagSet("pull", flag.ExitOnError)
	var o pullOptions
	fs.StringVar(&o.address, "address", "/run/containerd/containerd.sock", "containerd's socket")
	fs.StringVar(&o.namespace, "namespace", "default", "containerd namespace")
	fs.StringVar(&o.snapshotter, "snapshotter", defaultName, "the snapshotter's name in containerd's proxy_plugins")
	fs.BoolVar(&o.plainHTTP, "plain-http", false, "plain HTTP to the registry (default: HTTPS, except for localhost)")
	fs.StringVar(&o.auth, "auth", os.Getenv("BUI_REGISTRY_AUTH"), "registry credentials USER:PASS (default: env BUI_REGISTRY_AUTH, else docker's config.json)")
	fs.StringVar(&o.platform, "platform", "", "platform to pull (default: the host's)")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: btrfs-ublk-snapshotter pull [OPTIONS] REGISTRY/REPO[:TAG|@DIGEST]")
		fs.PrintDefaults()
	}
	_ = fs.Parse(args)
	if fs.NArg() != 1 {
		fs.Usage()
		os.Exit(2)
	}
	return pull(context.Background(), fs.Arg(0), o, os.Stdout)
}

func statusCommand(args []string) error {
	fs := flag.NewFlagSet("status", flag.ExitOnError)
	root := fs.String("root", defaultRoot, "the snapshotter's --root")
	asJSON := fs.Bool("json", false, "print status.json as it is")
	_ = fs.Parse(args)
	return printStatus(*root, *asJSON, os.Stdout)
}

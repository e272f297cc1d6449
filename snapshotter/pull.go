package main

// `pull`: containerd's client-side pull with unpacking into a snapshotter, which is what
// hands layer annotations to the snapshotter as labels (containerd 1.6's `ctr image pull`
// fetches every layer first and unpacks without them; nerdctl and the CRI do what this
// does). Works against containerd 1.6 and 2.x daemons.

import (
	"context"
	"fmt"
	"io"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/snapshotters"
	"github.com/containerd/errdefs"
	"github.com/opencontainers/image-spec/identity"
)

type pullOptions struct {
	address     string
	namespace   string
	snapshotter string
	plainHTTP   bool
	auth        string // USER:PASS
	platform    string
}

func pull(ctx context.Context, ref string, o pullOptions, w io.Writer) error {
	client, err := containerd.New(o.address, containerd.WithDefaultNamespace(o.namespace))
	if err != nil {
		return fmt.Errorf("containerd at %s: %w", o.address, err)
	}
	defer client.Close()

	resolver, err := newResolver(o.plainHTTP, o.auth)
	if err != nil {
		return err
	}

	start := time.Now()
	opts := []containerd.RemoteOpt{
		containerd.WithPullUnpack,
		containerd.WithPullSnapshotter(o.snapshotter),
		containerd.WithResolver(resolver),
		containerd.WithImageHandlerWrapper(snapshotters.AppendInfoHandlerWrapper(ref)),
	}
	if o.platform != "" {
		opts = append(opts, containerd.WithPlatform(o.platform))
	}
	img, err := client.Pull(ctx, ref, opts...)
	if err != nil {
		return fmt.Errorf("pull %s: %w", ref, err)
	}
	fmt.Fprintf(w, "%s: %s (%.2f s)\n", img.Name(), img.Target().Digest, time.Since(start).Seconds())

	// say how each layer was served: a bundle snapshot (lazy) or an unpacked one
	diffIDs, err := img.RootFS(ctx)
	if err != nil {
		return err
	}
	sn := client.SnapshotService(o.snapshotter)
	for i := range diffIDs {
		chain := identity.ChainID(diffIDs[:i+1]).String()
		info, err := sn.Stat(ctx, chain)
		if err != nil {
			if errdefs.IsNotFound(err) {
				return fmt.Errorf("layer %d: snapshot %s not found after the pull", i, chain)
			}
			return err
		}
		if b, ours, _ := bundleOf(info.Labels); ours {
			fmt.Fprintf(w, "layer %d: lazy: bundle %s (image id %s)\n", i, b.location, b.imageID)
		} else {
			fmt.Fprintf(w, "layer %d: downloaded and unpacked (ordinary layer)\n", i)
		}
	}
	return nil
}

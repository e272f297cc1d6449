package main

// `podman-store`: a static *additional layer store* for Podman / containers/storage
// (docs/containerd.md, "Podman"). containers/storage's overlay driver, configured with
//
//	[storage.options]
//	additionallayerstores = ["/var/lib/btrfs-ublk-podman:ref"]
//
// looks for every layer it is about to pull at STORE/<base64 of the image reference>/<layer
// digest>/ and, when `diff/`, `info` and `blob` are all there, takes the layer from there
// instead of downloading it: `diff/` becomes the layer's tree (its layer directory's diff
// is a symlink to it), `info` (a JSON storage.Layer) gives its digests and sizes.
// `podman-store REF` reads REF's runnable manifest (`push --image`, docs/containerd.md),
// mounts the placeholder layer's bundle there with `ublkd mount`, and writes `info` and an
// empty `blob`; `podman-store --remove REF` unmounts and removes it again.

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/core/remotes"
	"github.com/containerd/platforms"
	"github.com/distribution/reference"
	godigest "github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

const podmanUsage = `usage: btrfs-ublk-snapshotter podman-store --store DIR [OPTIONS] REGISTRY/REPO[:TAG|@DIGEST]
       btrfs-ublk-snapshotter podman-store --store DIR --remove REGISTRY/REPO[:TAG|@DIGEST]

Serves an image pushed with 'btrfs-ublk-image push --image' to Podman lazily: mounts its
bundle with 'ublkd mount' as the layer of a containers/storage additional layer store,
storage.conf: [storage.options] additionallayerstores = ["DIR:ref"]; then 'podman pull REF'.
Run it again for each reference podman pulls (the store is keyed by the reference).
`

type podmanOptions struct {
	store     string
	ublkd     ublkdArgv
	plainHTTP bool
	auth      string
	platform  string
}

func podmanStoreCommand(args []string) error {
	fs := flag.NewFlagSet("podman-store", flag.ExitOnError)
	var o podmanOptions
	fs.StringVar(&o.store, "store", "", "the additional layer store directory (storage.conf additionallayerstores = [\"DIR:ref\"])")
	remove := fs.Bool("remove", false, "unmount REF's layers and remove them from the store")
	fs.StringVar(&o.ublkd.bin, "ublkd", "ublkd", "the ublkd binary that mounts bundles")
	fs.Var((*repeated)(&o.ublkd.global), "ublkd-arg", "an option for every ublkd call, before its verb (repeatable)")
	fs.Var((*repeated)(&o.ublkd.mount), "mount-arg", "an option for ublkd mount (repeatable), e.g. --mount-arg=--cache-size=20G")
	fs.BoolVar(&o.plainHTTP, "plain-http", false, "plain HTTP to the registry (default: HTTPS, except for localhost)")
	fs.StringVar(&o.auth, "auth", os.Getenv("BUI_REGISTRY_AUTH"), "registry credentials USER:PASS (default: env BUI_REGISTRY_AUTH, else docker's config.json)")
	fs.StringVar(&o.platform, "platform", "", "platform of an image index to serve (default: the host's)")
	policy := addPolicyFlags(fs)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), podmanUsage)
		fs.PrintDefaults()
	}
	// options may follow the reference too
	var pos []string
	for _ = fs.Parse(args); fs.NArg() > 0; _ = fs.Parse(fs.Args()[1:]) {
		pos = append(pos, fs.Arg(0))
	}
	if len(pos) != 1 || o.store == "" {
		fs.Usage()
		os.Exit(2)
	}
	ref, err := podmanRef(pos[0])
	if err != nil {
		return err
	}
	store, err := filepath.Abs(o.store)
	if err != nil {
		return err
	}
	o.store = store
	extra, err := policy.mountArgs()
	if err != nil {
		return err
	}
	o.ublkd.mount = append(o.ublkd.mount, extra...)
	if *remove {
		return podmanRemove(context.Background(), ref, o, os.Stdout)
	}
	return podmanAdd(context.Background(), ref, o, os.Stdout)
}

// podmanRef is the reference as containers/image names it when it asks the store
// (`reference.Named.String()` of the pulled image: docker.io/library/... and :latest
// filled in).
func podmanRef(s string) (string, error) {
	named, err := reference.ParseDockerRef(s)
	if err != nil {
		return "", fmt.Errorf("%q: %w", s, err)
	}
	return named.String(), nil
}

// refDir is the store's directory of one image reference: containers/storage joins the
// store, base64 (standard alphabet, padded) of the reference, and the layer digest.
func refDir(store, ref string) string {
	return filepath.Join(store, base64.StdEncoding.EncodeToString([]byte(ref)))
}

// alsLayerInfo is the part of containers/storage's Layer (layers.go) that `info` carries.
type alsLayerInfo struct {
	CompressedDigest   godigest.Digest `json:"compressed-diff-digest"`
	CompressedSize     int64           `json:"compressed-size"`
	UncompressedDigest godigest.Digest `json:"diff-digest"`
	CompressionType    int             `json:"compression"`
}

// compressionOf maps a layer media type to containers/storage's archive.Compression.
func compressionOf(mediaType string) int {
	switch {
	case strings.HasSuffix(mediaType, "+gzip") || strings.HasSuffix(mediaType, ".gzip"):
		return 2 // archive.Gzip
	case strings.HasSuffix(mediaType, "+zstd") || strings.HasSuffix(mediaType, ".zstd"):
		return 4 // archive.Zstd
	default:
		return 0 // archive.Uncompressed
	}
}

func fetchJSON(ctx context.Context, f remotes.Fetcher, desc ocispec.Descriptor, v any) error {
	rc, err := f.Fetch(ctx, desc)
	if err != nil {
		return err
	}
	defer rc.Close()
	data, err := io.ReadAll(io.LimitReader(rc, 4<<20))
	if err != nil {
		return err
	}
	if got := godigest.FromBytes(data); got != desc.Digest {
		return fmt.Errorf("%s: the registry sent %s", desc.Digest, got)
	}
	return json.Unmarshal(data, v)
}

// podmanLayer is one placeholder layer the store serves.
type podmanLayer struct {
	desc   ocispec.Descriptor
	diffID godigest.Digest
	bundle bundleRef
}

// runnableLayers reads REF's manifest (the platform's, from an index) and config and
// returns its bundle layers.
func runnableLayers(ctx context.Context, ref string, o podmanOptions) ([]podmanLayer, error) {
	resolver, err := newResolver(o.plainHTTP, o.auth)
	if err != nil {
		return nil, err
	}
	name, desc, err := resolver.Resolve(ctx, ref)
	if err != nil {
		return nil, err
	}
	fetcher, err := resolver.Fetcher(ctx, name)
	if err != nil {
		return nil, err
	}
	if images.IsIndexType(desc.MediaType) {
		matcher := platforms.Default()
		if o.platform != "" {
			p, err := platforms.Parse(o.platform)
			if err != nil {
				return nil, err
			}
			matcher = platforms.Only(p)
		}
		var index ocispec.Index
		if err := fetchJSON(ctx, fetcher, desc, &index); err != nil {
			return nil, fmt.Errorf("index %s: %w", desc.Digest, err)
		}
		found := false
		for _, m := range index.Manifests {
			if m.Platform != nil && matcher.Match(*m.Platform) {
				desc, found = m, true
				break
			}
		}
		if !found {
			return nil, fmt.Errorf("index %s has no manifest for %s", desc.Digest, platforms.Format(platforms.DefaultSpec()))
		}
	}
	var manifest ocispec.Manifest
	if err := fetchJSON(ctx, fetcher, desc, &manifest); err != nil {
		return nil, fmt.Errorf("manifest %s: %w", desc.Digest, err)
	}
	var config ocispec.Image
	if err := fetchJSON(ctx, fetcher, manifest.Config, &config); err != nil {
		return nil, fmt.Errorf("config %s: %w", manifest.Config.Digest, err)
	}
	if len(config.RootFS.DiffIDs) != len(manifest.Layers) {
		return nil, fmt.Errorf("config %s: %d diff ids for %d layers", manifest.Config.Digest, len(config.RootFS.DiffIDs), len(manifest.Layers))
	}
	var out []podmanLayer
	for i, l := range manifest.Layers {
		labels := map[string]string{labelImageRef: ref, labelManifest: desc.Digest.String()}
		for k, v := range l.Annotations {
			labels[k] = v
		}
		b, ours, err := bundleOf(labels)
		if err != nil {
			return nil, fmt.Errorf("layer %s: %w", l.Digest, err)
		}
		if ours {
			out = append(out, podmanLayer{desc: l, diffID: config.RootFS.DiffIDs[i], bundle: b})
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%s (%s) is not a btrfs-ublk-image runnable image: no layer has the annotation %s"+
			" (push the bundle with `btrfs-ublk-image push --image` or `convert` it)", ref, desc.Digest, labelBundle)
	}
	return out, nil
}

func podmanAdd(ctx context.Context, ref string, o podmanOptions, w io.Writer) error {
	if st, err := os.Stat(o.store); err != nil || !st.IsDir() {
		return fmt.Errorf("--store %s: not a directory (create it; storage.conf names it)", o.store)
	}
	layers, err := runnableLayers(ctx, ref, o)
	if err != nil {
		return err
	}
	for _, l := range layers {
		dir := filepath.Join(refDir(o.store, ref), l.desc.Digest.String())
		if err := addLayer(ctx, dir, l, o.ublkd); err != nil {
			_ = os.Remove(refDir(o.store, ref)) // when it is empty: nothing left behind
			return err
		}
		fmt.Fprintf(w, "%s: layer %s: bundle %s (image id %s) at %s\n", ref, l.desc.Digest, l.bundle.location, l.bundle.imageID, filepath.Join(dir, "diff"))
	}
	return nil
}

// addLayer mounts the bundle at dir/diff, then writes info and (last: containers/storage
// takes the layer once diff, info and blob all exist) an empty blob.
func addLayer(ctx context.Context, dir string, l podmanLayer, u ublkdArgv) error {
	diff := filepath.Join(dir, "diff")
	if err := os.MkdirAll(diff, 0o755); err != nil {
		return err
	}
	if !isMountpoint(diff) {
		var rest []string
		if l.bundle.imageID != "" {
			rest = append(rest, "--expect-id", l.bundle.imageID)
		}
		rest = append(rest, l.bundle.location, diff)
		if err := runUblkd(ctx, u.bin, u.args("mount", rest...)); err != nil {
			_ = os.Remove(diff)
			_ = os.Remove(dir)
			return fmt.Errorf("layer %s: bundle %s (image %s): %w", l.desc.Digest, l.bundle.location, l.bundle.imageID, err)
		}
	}
	info, err := json.Marshal(alsLayerInfo{
		CompressedDigest:   l.desc.Digest,
		CompressedSize:     l.desc.Size,
		UncompressedDigest: l.diffID,
		CompressionType:    compressionOf(l.desc.MediaType),
	})
	if err != nil {
		return err
	}
	if err := writeFileAtomic(filepath.Join(dir, "info"), info); err != nil {
		return err
	}
	// `blob` would be the layer's compressed bytes, read when podman pushes or saves the
	// image; the store has none (the placeholder is never downloaded)
	return writeFileAtomic(filepath.Join(dir, "blob"), nil)
}

func writeFileAtomic(path string, data []byte) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// podmanRemove unmounts and removes every layer of REF in the store (no registry access).
// Podman's layers pulled from it point into the store: remove the image from podman first.
func podmanRemove(ctx context.Context, ref string, o podmanOptions, w io.Writer) error {
	rd := refDir(o.store, ref)
	entries, err := os.ReadDir(rd)
	if errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("%s: not in the store %s (%s)", ref, o.store, rd)
	} else if err != nil {
		return err
	}
	var errs []error
	for _, e := range entries {
		dir := filepath.Join(rd, e.Name())
		// blob and info first: containers/storage no longer finds a half-removed layer
		for _, f := range []string{"blob", "info", "blob.tmp", "info.tmp", "use"} {
			if err := os.Remove(filepath.Join(dir, f)); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, err)
			}
		}
		diff := filepath.Join(dir, "diff")
		if isMountpoint(diff) {
			if err := runUblkd(ctx, o.ublkd.bin, o.ublkd.args("umount", diff)); err != nil {
				errs = append(errs, err)
				continue
			}
		}
		if err := os.Remove(diff); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
			continue
		}
		if err := os.Remove(dir); err != nil {
			errs = append(errs, err)
			continue
		}
		fmt.Fprintf(w, "%s: layer %s removed\n", ref, e.Name())
	}
	// the reference's directory, and its parents up to the store where base64 had a '/'
	for d := rd; d != o.store && strings.HasPrefix(d, o.store+string(filepath.Separator)); d = filepath.Dir(d) {
		if os.Remove(d) != nil {
			break
		}
	}
	return errors.Join(errs...)
}

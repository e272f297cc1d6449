package main

// status.json: what the snapshotter serves, rewritten (atomically) after every change,
// so `btrfs-ublk-snapshotter status` and people can see whether an image was served
// lazily or its layers were downloaded, without opening the metadata database.

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"sync"

	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
)

type lazyImage struct {
	Snapshot   string `json:"snapshot"`
	ImageID    string `json:"image_id"`
	Bundle     string `json:"bundle"`
	Mountpoint string `json:"mountpoint"`
	Mounted    bool   `json:"mounted"`
}

type ordinaryLayer struct {
	Snapshot string `json:"snapshot"`
	Layer    string `json:"layer,omitempty"`
}

type status struct {
	// bundle layers: mounted by ublkd, their blobs never downloaded
	Lazy []lazyImage `json:"lazy"`
	// committed layers of ordinary images: downloaded and unpacked by containerd
	Downloaded []ordinaryLayer `json:"downloaded"`
	Active     int             `json:"active"` // containers' writable snapshots and views
}

type statusFile struct {
	path string
	mu   sync.Mutex
}

func (f *statusFile) refresh(ctx context.Context, s *snapshotter) {
	f.mu.Lock()
	defer f.mu.Unlock()
	st := status{Lazy: []lazyImage{}, Downloaded: []ordinaryLayer{}}
	err := s.Snapshotter.Walk(ctx, func(ctx context.Context, info snapshots.Info) error {
		if info.Kind != snapshots.KindCommitted {
			st.Active++
			return nil
		}
		b, ours, _ := bundleOf(info.Labels)
		if !ours {
			st.Downloaded = append(st.Downloaded, ordinaryLayer{info.Name, info.Labels[labelLayer]})
			return nil
		}
		dir, err := s.fsDir(ctx, info.Name)
		if err != nil {
			return err
		}
		st.Lazy = append(st.Lazy, lazyImage{info.Name, b.imageID, b.location, dir, isMountpoint(dir)})
		return nil
	})
	if err == nil || errdefs.IsNotFound(err) { // not found: an empty database
		sort.Slice(st.Lazy, func(i, j int) bool { return st.Lazy[i].Snapshot < st.Lazy[j].Snapshot })
		sort.Slice(st.Downloaded, func(i, j int) bool { return st.Downloaded[i].Snapshot < st.Downloaded[j].Snapshot })
		err = writeJSON(f.path, st)
	}
	if err != nil {
		log.G(ctx).WithError(err).Warn("cannot write " + f.path)
	}
}

func writeJSON(path string, v any) error {
	data, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".status-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(append(data, '\n')); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// printStatus: the `status` command.
func printStatus(root string, asJSON bool, w io.Writer) error {
	path := filepath.Join(root, "status.json")
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("%s: %w (is the snapshotter running with --root %s?)", path, err, root)
	}
	if asJSON {
		_, err = w.Write(data)
		return err
	}
	var st status
	if err := json.Unmarshal(data, &st); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	fmt.Fprintf(w, "lazy (bundle mounted by ublkd, layer blob never downloaded): %d\n", len(st.Lazy))
	for _, l := range st.Lazy {
		state := "mounted"
		if !l.Mounted {
			state = "NOT MOUNTED (remounted on next use)"
		}
		fmt.Fprintf(w, "  %s  image %s  %s  %s\n", l.Snapshot, l.ImageID, l.Bundle, state)
	}
	fmt.Fprintf(w, "downloaded (ordinary layers, unpacked by containerd): %d\n", len(st.Downloaded))
	for _, d := range st.Downloaded {
		fmt.Fprintf(w, "  %s  layer %s\n", d.Snapshot, d.Layer)
	}
	fmt.Fprintf(w, "active snapshots (containers, views): %d\n", st.Active)
	return nil
}

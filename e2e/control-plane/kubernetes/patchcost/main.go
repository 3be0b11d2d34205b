// Command patchcost times what the pinned kube-apiserver does with a mutating webhook's JSON
// patch once the webhook has answered (k8s.io/apiserver's webhook/mutating/dispatcher.go, the
// steps after the call, in its order), then the patched pod's conversion back to the internal
// type and its create validation (the pod strategy's), for each patch given, alternated in
// every round, on the pod as the API server sends it. It runs the pinned modules' own code:
// the core group's scheme with its defaulters (as the API server installs it),
// gopkg.in/evanphx/json-patch.v4, the apimachinery JSON serializer. Issue 22.2 (BENCHMARKS.md, part 3): what any webhook answering
// a given patch costs the API server, apart from the webhook.
//
//	patchcost [-rounds N] [-calls N] POD.json NAME=PATCH.json...
package main

import (
	"flag"
	"fmt"
	"os"
	"sort"
	"strings"
	"time"

	jsonpatch "gopkg.in/evanphx/json-patch.v4"
	admissionv1 "k8s.io/api/admission/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer/json"
	utiljson "k8s.io/apimachinery/pkg/util/json"
	"k8s.io/kubernetes/pkg/api/legacyscheme"
	podutil "k8s.io/kubernetes/pkg/api/pod"
	"k8s.io/kubernetes/pkg/apis/core"
	_ "k8s.io/kubernetes/pkg/apis/core/install"
	"k8s.io/kubernetes/pkg/apis/core/validation"
)

// The steps timed: the dispatcher's, in its order, then the create's on the patched pod.
var steps = []string{"decode the patch", "encode the pod", "apply", "decode the result", "compare", "audit annotation", "default", "convert to internal", "validate the create"}

type patch struct {
	name string
	text []byte
	// Per round: µs per call of each step.
	perRound [][]float64
}

func main() {
	rounds := flag.Int("rounds", 21, "rounds, each running every patch in turn")
	calls := flag.Int("calls", 1000, "calls per patch per round")
	flag.Parse()
	if flag.NArg() < 2 || *rounds < 1 || *calls < 1 {
		fmt.Fprintln(os.Stderr, "usage: patchcost [-rounds N] [-calls N] POD.json NAME=PATCH.json...")
		os.Exit(2)
	}
	if err := run(*rounds, *calls, flag.Arg(0), flag.Args()[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "patchcost:", err)
		os.Exit(1)
	}
}

func run(rounds, calls int, podFile string, patchArgs []string) error {
	scheme := legacyscheme.Scheme
	serializer := json.NewSerializerWithOptions(json.DefaultMetaFactory, scheme, scheme, json.SerializerOptions{})
	podJSON, err := os.ReadFile(podFile)
	if err != nil {
		return err
	}
	kind := schema.GroupVersionKind{Version: "v1", Kind: "Pod"}
	sent, err := scheme.New(kind)
	if err != nil {
		return err
	}
	if sent, _, err = serializer.Decode(podJSON, &kind, sent); err != nil {
		return fmt.Errorf("%s: %w", podFile, err)
	}
	var patches []*patch
	for _, arg := range patchArgs {
		name, file, ok := strings.Cut(arg, "=")
		if !ok {
			return fmt.Errorf("%q is not NAME=FILE", arg)
		}
		text, err := os.ReadFile(file)
		if err != nil {
			return err
		}
		patches = append(patches, &patch{name: name, text: text})
	}
	for round := 0; round < rounds; round++ {
		for _, p := range patches {
			took := make([]time.Duration, len(steps))
			for call := 0; call < calls; call++ {
				if err := once(scheme, serializer, sent, kind, p.text, took); err != nil {
					return fmt.Errorf("%s: %w", p.name, err)
				}
			}
			perCall := make([]float64, len(steps))
			for i, d := range took {
				perCall[i] = float64(d.Nanoseconds()) / float64(calls) / 1000
			}
			p.perRound = append(p.perRound, perCall)
		}
	}
	report(patches, rounds, calls)
	return nil
}

// once runs the dispatcher's steps for one answered patch, adding each step's time to took.
func once(scheme *runtime.Scheme, serializer *json.Serializer, sent runtime.Object, kind schema.GroupVersionKind, text []byte, took []time.Duration) error {
	t0 := time.Now()
	decoded, err := jsonpatch.DecodePatch(text)
	if err != nil {
		return err
	}
	t1 := time.Now()
	objJS, err := runtime.Encode(serializer, sent)
	if err != nil {
		return err
	}
	t2 := time.Now()
	patchedJS, err := decoded.Apply(objJS)
	if err != nil {
		return err
	}
	t3 := time.Now()
	patched, err := scheme.New(kind)
	if err != nil {
		return err
	}
	if patched, _, err = serializer.Decode(patchedJS, nil, patched); err != nil {
		return err
	}
	t4 := time.Now()
	if apiequality.Semantic.DeepEqual(sent, patched) {
		return fmt.Errorf("the patch changed nothing")
	}
	t5 := time.Now()
	// jsonPatchAnnotationValue: composed for every patch, kept only at audit level Request.
	if _, err := utiljson.Marshal(map[string]any{"configuration": "bench", "webhook": "bench",
		"patch": decoded, "patchType": string(admissionv1.PatchTypeJSONPatch)}); err != nil {
		return err
	}
	t6 := time.Now()
	scheme.Default(patched)
	t7 := time.Now()
	internal := &core.Pod{}
	if err := scheme.Convert(patched, internal, nil); err != nil {
		return err
	}
	t8 := time.Now()
	options := podutil.GetValidationOptionsFromPodSpecAndMeta(&internal.Spec, nil, &internal.ObjectMeta, nil)
	if errs := validation.ValidatePodCreate(internal, options); len(errs) > 0 {
		return errs.ToAggregate()
	}
	t9 := time.Now()
	for i, d := range []time.Duration{t1.Sub(t0), t2.Sub(t1), t3.Sub(t2), t4.Sub(t3), t5.Sub(t4), t6.Sub(t5), t7.Sub(t6), t8.Sub(t7), t9.Sub(t8)} {
		took[i] += d
	}
	return nil
}

// spread is the median, min and max of values.
func spread(values []float64) (median, least, most float64) {
	sorted := append([]float64(nil), values...)
	sort.Float64s(sorted)
	return sorted[len(sorted)/2], sorted[0], sorted[len(sorted)-1]
}

// report prints each step's median over the rounds (µs per call) for every patch, the total's
// median, min and max, and each patch's total over the first patch's, paired by round.
func report(patches []*patch, rounds, calls int) {
	fmt.Printf("The API server's own steps on a webhook's answer (µs per call, medians of %d rounds of %d calls):\n\n", rounds, calls)
	fmt.Printf("| step |")
	for _, p := range patches {
		fmt.Printf(" %s (%d bytes) |", p.name, len(p.text))
	}
	fmt.Printf("\n|---|")
	for range patches {
		fmt.Printf("---|")
	}
	fmt.Println()
	column := func(p *patch, f func([]float64) float64) []float64 {
		out := make([]float64, len(p.perRound))
		for r, perCall := range p.perRound {
			out[r] = f(perCall)
		}
		return out
	}
	for i, step := range steps {
		fmt.Printf("| %s |", step)
		for _, p := range patches {
			median, _, _ := spread(column(p, func(c []float64) float64 { return c[i] }))
			fmt.Printf(" %.1f |", median)
		}
		fmt.Println()
	}
	total := func(c []float64) float64 {
		sum := 0.0
		for _, v := range c {
			sum += v
		}
		return sum
	}
	fmt.Printf("| **all** (min-max) |")
	for _, p := range patches {
		median, least, most := spread(column(p, total))
		fmt.Printf(" **%.1f** (%.1f-%.1f) |", median, least, most)
	}
	fmt.Println()
	first := column(patches[0], total)
	for _, p := range patches[1:] {
		t := column(p, total)
		over := make([]float64, len(t))
		for r := range t {
			over[r] = t[r] - first[r]
		}
		median, least, most := spread(over)
		fmt.Printf("\n%s over %s, paired by round: %.1f µs per call (min %.1f, max %.1f)", p.name, patches[0].name, median, least, most)
	}
	fmt.Println()
}

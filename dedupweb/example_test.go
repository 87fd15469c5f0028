package dedupweb_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/alicebob/miniredis/v2"
	"github.com/asynq-dedup/dedup/dedupweb"
	"github.com/redis/go-redis/v9"
)

// Mount the lock browser next to asynqmon, read-only, under /dedup.
func ExampleNew() {
	mr, err := miniredis.Run() // your Redis, the one asynq and dedup use
	if err != nil {
		panic(err)
	}
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()

	mux := http.NewServeMux()
	mux.Handle("/dedup/", dedupweb.New(rdb, dedupweb.Options{
		RootPath:     "/dedup",
		AsynqmonRoot: "/monitoring", // where asynqmon is mounted
	}))

	rec := httptest.NewRecorder()
	mux.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/dedup/", nil))
	fmt.Println(rec.Code, strings.Contains(rec.Body.String(), "No locks are held under this prefix."))
	// Output: 200 true
}
